//! Policy files: spec (serde TOML) → compile (validate, all errors) → store (ArcSwap) →
//! watch (notify, SIGHUP and the admin listener feed the same reload).

pub mod compile;
pub mod diag;
pub mod policy;
pub mod spec;
pub mod store;
pub mod units;
pub mod watch;

pub use compile::{compile, load_dir, read_dir};
pub use diag::{Diagnostic, Diagnostics, SourceFile};
pub use policy::Policy;
pub use store::{PolicyStore, ReloadTrigger};
