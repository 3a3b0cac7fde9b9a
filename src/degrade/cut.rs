//! The fast path of `hide` for id selectors: find the element's start tag and its matching end
//! tag with a small tag scanner, and drop the bytes in between, without running the HTML
//! rewriter over them.
//!
//! A full HTML parser costs a few hundred instructions per byte of the module it removes,
//! which made hiding a module the most expensive thing levee did to a page. An element chosen
//! by id is removed whole, so only its extent matters: the start tag, then same-named tags
//! tracked in and out (skipping comments and every tag's quoted attributes) until its end tag,
//! with the rewriter's rule that an end tag closes everything opened after the element it
//! names. Anything this scanner is not sure about — raw-text elements such as `<script>`
//! inside the module, foreign content, CDATA, an element outside the plain containers
//! below — is handed back to the rewriter, which then sees exactly the bytes it would have
//! seen without the fast path. A module whose own end tag is missing ends where HTML's tree
//! builder ends it (an end tag of an element around it, a start tag of its own kind), or,
//! where that depends on the page before it, early: some of it left in place rather than the
//! rest of the page removed.

/// Elements the fast path removes: plain containers, which HTML never closes implicitly when
/// content opens (unlike `<p>`, `<li>` or table parts). A well-formed module of one of these
/// ends at its own end tag, whatever it contains; others are left to the rewriter.
const CONTAINERS: &[&[u8]] = &[
    b"div",
    b"section",
    b"aside",
    b"nav",
    b"article",
    b"header",
    b"footer",
    b"main",
    b"table",
    b"ul",
    b"ol",
    b"dl",
    b"form",
    b"span",
    b"figure",
    b"details",
    b"fieldset",
    b"center",
    b"blockquote",
];

fn is_one_of(name: &[u8], set: &[&[u8]]) -> bool {
    set.contains(&name)
}

/// Where an element whose end tag HTML lets a page leave out (`<li>a<li>b`, `<p>a<div>`) ends
/// when it is left out, as HTML's tree builder ends it: before the start tag of a sibling
/// (`starts`), or before the end tag of an element around it (`ends`). Only the plain case
/// is taken: the element is the innermost one open, or the start tag is nested inside a list
/// or table opened within it (`nests`). Anything else (an implied end with elements still
/// open inside, which HTML may re-open after it) is handed to the rewriter, which leaves
/// the element in place.
#[derive(Debug)]
struct OptionalEnd {
    starts: Names,
    ends: Names,
    nests: Names,
    /// Table rows, cells and sections: their implied end closes whatever is open inside
    /// them, and nothing of it is re-opened after (formatting elements stop at a cell).
    closes_inner: bool,
}

impl OptionalEnd {
    /// Whether the end tag `name` (lower case), matching nothing open inside the element,
    /// closes it. `</li>`, `</dd>` and `</dt>` close a `<p>` inside the item too.
    fn ended_by(&self, name: &[u8], removed: &[u8]) -> bool {
        is_one_of(name, self.ends) || (removed == b"p" && matches!(name, b"li" | b"dd" | b"dt"))
    }
}

/// End tags that close every element HTML lets go unclosed inside them (they "generate
/// implied end tags"): the block containers, tables and their parts, forms, the body.
const CLOSING_ENDS: &[&[u8]] = &[
    b"address",
    b"article",
    b"aside",
    b"blockquote",
    b"body",
    b"button",
    b"caption",
    b"center",
    b"details",
    b"dialog",
    b"dir",
    b"div",
    b"dl",
    b"fieldset",
    b"figcaption",
    b"figure",
    b"footer",
    b"form",
    b"h1",
    b"h2",
    b"h3",
    b"h4",
    b"h5",
    b"h6",
    b"header",
    b"hgroup",
    b"html",
    b"listing",
    b"main",
    b"marquee",
    b"menu",
    b"nav",
    b"object",
    b"ol",
    b"pre",
    b"search",
    b"section",
    b"summary",
    b"table",
    b"tbody",
    b"td",
    b"template",
    b"tfoot",
    b"th",
    b"thead",
    b"tr",
    b"ul",
    b"applet",
];

/// Start tags that end an open `<p>` (HTML: "close a p element"). `<table>` is left out: in
/// quirks mode, which many legacy pages are in, it does not.
const P_CLOSING_STARTS: &[&[u8]] = &[
    b"address",
    b"article",
    b"aside",
    b"blockquote",
    b"center",
    b"dd",
    b"details",
    b"dialog",
    b"dir",
    b"div",
    b"dl",
    b"dt",
    b"fieldset",
    b"figcaption",
    b"figure",
    b"footer",
    b"form",
    b"h1",
    b"h2",
    b"h3",
    b"h4",
    b"h5",
    b"h6",
    b"header",
    b"hgroup",
    b"hr",
    b"li",
    b"listing",
    b"main",
    b"menu",
    b"nav",
    b"ol",
    b"p",
    b"pre",
    b"search",
    b"section",
    b"summary",
    b"ul",
];

/// A set of lower-case element names.
type Names = &'static [&'static [u8]];

const IN_TABLE: &[&[u8]] = &[b"table"];

fn optional_end(name: &[u8]) -> Option<OptionalEnd> {
    let (starts, ends, nests): (Names, Names, Names) = match name {
        b"li" => (&[b"li"], CLOSING_ENDS, &[b"ul", b"ol", b"menu"]),
        b"dt" | b"dd" => (&[b"dt", b"dd"], CLOSING_ENDS, &[b"dl"]),
        // `</li>`, `</dd>` and `</dt>` close a `<p>` inside the item too.
        b"p" => (P_CLOSING_STARTS, CLOSING_ENDS, &[]),
        // In a select, `<hr>` ends an option, and `<input>`, `<textarea>`, `<select>` end the
        // select itself.
        b"option" => (
            &[
                b"option",
                b"optgroup",
                b"hr",
                b"input",
                b"keygen",
                b"select",
                b"textarea",
            ],
            &[b"select", b"optgroup", b"datalist"],
            &[],
        ),
        b"tr" => (
            &[
                b"tr",
                b"tbody",
                b"thead",
                b"tfoot",
                b"caption",
                b"colgroup",
                b"col",
            ],
            &[b"tbody", b"thead", b"tfoot", b"table"],
            IN_TABLE,
        ),
        b"td" | b"th" => (
            &[
                b"td",
                b"th",
                b"tr",
                b"tbody",
                b"thead",
                b"tfoot",
                b"caption",
                b"colgroup",
                b"col",
            ],
            &[b"tr", b"tbody", b"thead", b"tfoot", b"table"],
            IN_TABLE,
        ),
        b"tbody" | b"thead" | b"tfoot" => (
            &[
                b"tbody",
                b"thead",
                b"tfoot",
                b"caption",
                b"colgroup",
                b"col",
            ],
            &[b"table"],
            IN_TABLE,
        ),
        _ => return None,
    };
    Some(OptionalEnd {
        starts,
        ends,
        nests,
        closes_inner: nests == IN_TABLE,
    })
}

/// Elements whose end tag a page must write, but which HTML ends before a start tag of their
/// own kind all the same: a link that starts in a link, a button in a button (`nobr` too), a
/// heading right inside a heading. A module of one of these missing its end tag ended only with
/// the page.
/// (Headings: [`HEADINGS`].)
const ENDED_BY_THEIR_KIND: &[&[u8]] = &[b"a", b"button", b"nobr"];

const HEADINGS: &[&[u8]] = &[b"h1", b"h2", b"h3", b"h4", b"h5", b"h6"];

/// Whether the fast path removes elements of this (lower-case) name.
pub fn is_cut_whole(name: &[u8]) -> bool {
    is_void(name)
        || is_one_of(name, CONTAINERS)
        || is_one_of(name, ENDED_BY_THEIR_KIND)
        || is_one_of(name, HEADINGS)
        || optional_end(name).is_some()
}

/// The elements that bound HTML's "has an element in scope" search (HTML's default scope;
/// MathML and SVG ones are left out: the scanner gives up on foreign content). An end tag that
/// closes elements in scope, written inside one of these, closes nothing outside it.
const DEFAULT_SCOPE: &[&[u8]] = &[
    b"applet",
    b"caption",
    b"html",
    b"table",
    b"td",
    b"th",
    b"marquee",
    b"object",
    b"template",
];

/// The default scope and lists: where `</li>` stops looking.
const LIST_ITEM_SCOPE: &[&[u8]] = &[
    b"applet",
    b"caption",
    b"html",
    b"table",
    b"td",
    b"th",
    b"marquee",
    b"object",
    b"template",
    b"ol",
    b"ul",
];

/// Where the end tags of tables and their parts stop looking.
const TABLE_SCOPE: &[&[u8]] = &[b"html", b"table", b"template"];

/// HTML's "special" elements (MathML and SVG ones left out): an end tag of a name HTML has no
/// rule of its own for stops looking for its element at the first of these, and is ignored.
const SPECIAL: &[&[u8]] = &[
    b"address",
    b"applet",
    b"area",
    b"article",
    b"aside",
    b"base",
    b"basefont",
    b"bgsound",
    b"blockquote",
    b"body",
    b"br",
    b"button",
    b"caption",
    b"center",
    b"col",
    b"colgroup",
    b"dd",
    b"details",
    b"dir",
    b"div",
    b"dl",
    b"dt",
    b"embed",
    b"fieldset",
    b"figcaption",
    b"figure",
    b"footer",
    b"form",
    b"frame",
    b"frameset",
    b"h1",
    b"h2",
    b"h3",
    b"h4",
    b"h5",
    b"h6",
    b"head",
    b"header",
    b"hgroup",
    b"hr",
    b"html",
    b"iframe",
    b"img",
    b"input",
    b"keygen",
    b"li",
    b"link",
    b"listing",
    b"main",
    b"marquee",
    b"menu",
    b"meta",
    b"nav",
    b"noembed",
    b"noframes",
    b"noscript",
    b"object",
    b"ol",
    b"p",
    b"param",
    b"plaintext",
    b"pre",
    b"script",
    b"search",
    b"section",
    b"select",
    b"source",
    b"style",
    b"summary",
    b"table",
    b"tbody",
    b"td",
    b"template",
    b"textarea",
    b"tfoot",
    b"th",
    b"thead",
    b"title",
    b"tr",
    b"track",
    b"ul",
    b"wbr",
    b"xmp",
];

/// What HTML's tree builder does with an end tag (lower-case name) when it meets one, as far
/// as ending a removed element goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EndRule {
    /// Closes the innermost element of its name open within the scope these elements bound
    /// (`</div>`, `</li>`, `</td>` …; headings close any heading), and everything opened
    /// after it; ignored when there is none.
    InScope(Names),
    /// Never closes the elements open after its own (`</form>`, `</body>`, `</html>`: content
    /// after them still goes into the open element), or makes an element when nothing
    /// matches (`</p>`, `</br>`): matched only by name, and otherwise left as it comes.
    Kept,
    /// Any other end tag (`</span>`, `</b>`, custom elements): closes the innermost element of
    /// its name unless a special element lies in between, which makes it ignored.
    Other,
}

fn end_rule(name: &[u8]) -> EndRule {
    match name {
        b"li" => EndRule::InScope(LIST_ITEM_SCOPE),
        b"table" | b"tbody" | b"thead" | b"tfoot" | b"tr" | b"td" | b"th" | b"caption" => {
            EndRule::InScope(TABLE_SCOPE)
        }
        // Closed by `</template>` only when one is open; inside the removed element it cannot
        // be (the scanner gives up on templates).
        b"template" => EndRule::InScope(&[]),
        b"p" | b"br" | b"form" | b"body" | b"html" | b"head" | b"col" | b"colgroup" | b"frame" => {
            EndRule::Kept
        }
        _ if is_one_of(name, CLOSING_ENDS) || is_one_of(name, HEADINGS) => {
            EndRule::InScope(DEFAULT_SCOPE)
        }
        b"dd" | b"dt" => EndRule::InScope(DEFAULT_SCOPE),
        _ => EndRule::Other,
    }
}

/// Has this element (lower-case name) no end tag? Removing one removes its start tag only.
pub fn is_void(name: &[u8]) -> bool {
    kind_of(name) == NameKind::Void
}

/// The [`NameKind`] of a name (names longer than any listed one are `Other`).
fn kind_of(name: &[u8]) -> NameKind {
    OpenName::inline_at(name, 0, name.len()).map_or(NameKind::Other, OpenName::kind)
}

/// An id selector the fast path can handle: `#id` or `tag#id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdSelector {
    /// Lower-case tag name the element must have, if the selector names one.
    pub tag: Option<Vec<u8>>,
    pub id: Vec<u8>,
}

impl IdSelector {
    pub fn parse(selector: &str) -> Option<IdSelector> {
        let (tag, id) = selector.trim().split_once('#')?;
        let plain = |text: &str| {
            text.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if id.is_empty() || !plain(id) || !plain(tag) {
            return None;
        }
        Some(IdSelector {
            tag: (!tag.is_empty()).then(|| tag.to_ascii_lowercase().into_bytes()),
            id: id.as_bytes().to_vec(),
        })
    }
}

/// A lower-case tag name. Names of up to `SHORT_NAME` bytes (every HTML element's, and most
/// custom ones) are kept inline: a module's hundreds of tags are read without allocating.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TagName {
    Short { len: u8, bytes: [u8; SHORT_NAME] },
    Long(Vec<u8>),
}

const SHORT_NAME: usize = 16;

impl TagName {
    pub fn lowercase(raw: &[u8]) -> TagName {
        if raw.len() <= SHORT_NAME {
            TagName::Short {
                // At most SHORT_NAME, which fits.
                len: raw.len() as u8,
                bytes: lowercase_word(raw).to_le_bytes(),
            }
        } else {
            TagName::Long(raw.to_ascii_lowercase())
        }
    }
}

/// `raw` (at most 16 bytes) lower-cased into one word, zero past its end: gathered and
/// lower-cased in registers, so that it is stored once, whole (see [`OpenName`]). A `const fn`:
/// the words of the names in `KIND_TABLE` are made by it too.
const fn lowercase_word(raw: &[u8]) -> u128 {
    debug_assert!(raw.len() <= 16);
    let mut word = 0u128;
    let mut at = 0;
    while at < raw.len() && at < 16 {
        word |= (raw[at] as u128) << (8 * at);
        at += 1;
    }
    ascii_lowercase_word(word)
}

/// [`lowercase_word`] of `buf[start..start + len]` (`len` at most 16), read with one load
/// when 16 bytes are there to read.
#[inline(always)]
fn lowercase_word_at(buf: &[u8], start: usize, len: usize) -> u128 {
    debug_assert!(len <= 16);
    match buf
        .get(start..start + 16)
        .and_then(|bytes| <[u8; 16]>::try_from(bytes).ok())
    {
        Some(bytes) => {
            let word = u128::from_le_bytes(bytes) & KEEP_FIRST[len.min(16)];
            // Most names fit in the low half: the high half is then zero, and stays so.
            if len <= 8 {
                u128::from(ascii_lowercase_half(word as u64))
            } else {
                ascii_lowercase_word(word)
            }
        }
        None => lowercase_word(&buf[start..start + len]),
    }
}

/// `KEEP_FIRST[n]` keeps the first `n` bytes of a word (a table: a shift of a 128-bit word by a
/// variable amount takes several instructions, and this runs for every tag of a module).
const KEEP_FIRST: [u128; 17] = {
    let mut masks = [0u128; 17];
    let mut n = 1;
    while n < 17 {
        masks[n] = (masks[n - 1] << 8) | 0xff;
        n += 1;
    }
    masks
};

/// `to_ascii_lowercase` of each of the 16 bytes of `word` at once: bytes `A`–`Z` get the
/// 0x20 bit, every other byte (non-ASCII ones included) stays as it is.
const fn ascii_lowercase_word(word: u128) -> u128 {
    let low = ascii_lowercase_half(word as u64);
    let high = ascii_lowercase_half((word >> 64) as u64);
    (low as u128) | ((high as u128) << 64)
}

/// [`ascii_lowercase_word`] of eight bytes.
#[inline]
const fn ascii_lowercase_half(word: u64) -> u64 {
    const LOW_SEVEN: u64 = u64::from_ne_bytes([0x7f; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    // Added to a byte's low seven bits, these set its high bit from `A` on and from past `Z`
    // on; no sum reaches the next byte (at most 0x7f + 0x3f).
    const FROM_A: u64 = u64::from_ne_bytes([0x80 - b'A'; 8]);
    const PAST_Z: u64 = u64::from_ne_bytes([0x80 - b'Z' - 1; 8]);
    let low = word & LOW_SEVEN;
    let upper = (low + FROM_A) & !(low + PAST_Z) & !word & HIGH;
    word | (upper >> 2)
}

/// An element open inside a removed one, as one 16-byte word: its lower-case name when that
/// is at most `INLINE` bytes, with the length in the top byte, or else `LONG` in the top byte
/// and the name's index in [`Cut::long_names`]. A name is pushed for each start tag of a
/// removed module, and an enum of its bytes was copied in pieces that the CPU could not serve
/// from the stores just made (a load spanning several stores stalls it): that stall cost
/// more than the rest of the tag's scanning. One word, built in registers, is stored and
/// loaded whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OpenName(u128);

impl OpenName {
    const INLINE: usize = 15;
    const LONG: u128 = 0xff;

    /// The inline word of `buf[start..start + len]`, if it is short enough to have one.
    #[inline(always)]
    fn inline_at(buf: &[u8], start: usize, len: usize) -> Option<OpenName> {
        (len <= OpenName::INLINE)
            .then(|| OpenName::of_word(lowercase_word_at(buf, start, len), len))
    }

    /// The inline name whose lower-case bytes are `word` (`len` at most `INLINE`).
    const fn of_word(word: u128, len: usize) -> OpenName {
        OpenName(word | ((len as u128) << 120))
    }

    /// The index of a long name in `Cut::long_names`.
    fn long_index(self) -> Option<usize> {
        (self.0 >> 120 == OpenName::LONG).then_some((self.0 & u128::from(u32::MAX)) as usize)
    }

    /// Whether this element's name is one of `set` (lower case; every name in a set is
    /// inline).
    fn is_one_of(self, set: &[&[u8]]) -> bool {
        self.long_index().is_none() && {
            let bytes = self.0.to_le_bytes();
            is_one_of(&bytes[..usize::from(bytes[15])], set)
        }
    }
}

/// What a start tag's name means to the scanner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NameKind {
    /// A void element: it has no end tag, and never opens.
    Void,
    /// An element whose content is not markup (raw text, foreign content, templates): the
    /// scanner gives up.
    NotMarkup,
    Other,
}

/// The inline [`OpenName`] word of a name of at most `OpenName::INLINE` bytes, at compile
/// time, so that names are told apart by comparing words.
const fn inline_word(name: &[u8]) -> u128 {
    assert!(name.len() <= OpenName::INLINE, "not an inline name");
    OpenName::of_word(lowercase_word(name), name.len()).0
}

/// The names [`NameKind`] tells apart from the rest, HTML's void elements and the elements
/// whose content is not markup: the one list behind [`is_void`] and [`OpenName::kind`].
const KINDS: &[(&[u8], NameKind)] = &[
    (b"area", NameKind::Void),
    (b"base", NameKind::Void),
    (b"br", NameKind::Void),
    (b"col", NameKind::Void),
    (b"embed", NameKind::Void),
    (b"hr", NameKind::Void),
    (b"img", NameKind::Void),
    (b"input", NameKind::Void),
    (b"link", NameKind::Void),
    (b"meta", NameKind::Void),
    (b"source", NameKind::Void),
    (b"track", NameKind::Void),
    (b"wbr", NameKind::Void),
    (b"script", NameKind::NotMarkup),
    (b"style", NameKind::NotMarkup),
    (b"textarea", NameKind::NotMarkup),
    (b"title", NameKind::NotMarkup),
    (b"xmp", NameKind::NotMarkup),
    (b"iframe", NameKind::NotMarkup),
    (b"noembed", NameKind::NotMarkup),
    (b"noframes", NameKind::NotMarkup),
    (b"noscript", NameKind::NotMarkup),
    (b"plaintext", NameKind::NotMarkup),
    (b"svg", NameKind::NotMarkup),
    (b"math", NameKind::NotMarkup),
    (b"template", NameKind::NotMarkup),
];

/// A multiplier that sends each name of `KINDS` to a slot of its own in `KIND_TABLE` (found by
/// trying odd numbers; the table's construction fails to compile if two names share a slot).
/// A start tag's name is then looked up with one multiplication and one comparison: matching
/// it against the 26 words took some 35 instructions a tag.
const KIND_HASH: u64 = 0x842e_7fc2_2954_0a6f;

const fn kind_slot(word: u128) -> usize {
    (((word as u64) ^ ((word >> 64) as u64)).wrapping_mul(KIND_HASH) >> 58) as usize
}

/// Per slot, the inline word of the name of `KINDS` there (0, which no name's word is, when
/// none is) and its kind.
const KIND_TABLE: [(u128, NameKind); 64] = {
    let mut table = [(0u128, NameKind::Other); 64];
    let mut at = 0;
    while at < KINDS.len() {
        let (name, kind) = KINDS[at];
        let word = inline_word(name);
        let slot = kind_slot(word);
        assert!(
            table[slot].0 == 0,
            "two names of KINDS share a slot: pick another KIND_HASH"
        );
        table[slot] = (word, kind);
        at += 1;
    }
    table
};

impl OpenName {
    /// What this (inline) name means to the scanner.
    fn kind(self) -> NameKind {
        let (word, kind) = KIND_TABLE[kind_slot(self.0)];
        if word == self.0 {
            kind
        } else {
            NameKind::Other
        }
    }
}

/// The [`OpenName`] of `name` (lower case), kept aside in `long_names` when it is long.
fn open_name(long_names: &mut Vec<Vec<u8>>, name: &[u8]) -> OpenName {
    OpenName::inline_at(name, 0, name.len()).unwrap_or_else(|| {
        long_names.push(name.to_vec());
        OpenName((OpenName::LONG << 120) | (long_names.len() - 1) as u128)
    })
}

impl std::ops::Deref for TagName {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            TagName::Short { len, bytes } => &bytes[..usize::from(*len)],
            TagName::Long(bytes) => bytes,
        }
    }
}

/// A tag as the scanner read it.
#[derive(Debug, PartialEq, Eq)]
pub struct Tag {
    pub name: TagName,
    /// Offset just past the closing `>`.
    pub end: usize,
    pub self_closing: bool,
    /// Value of the first `id` attribute, as a range of the buffer.
    pub id: Option<(usize, usize)>,
}

/// The outcome of reading a tag from `buf[at]`, which must be `<` followed by a letter (start
/// tag) or `</` and a letter (end tag; `at + 2`).
#[derive(Debug, PartialEq, Eq)]
pub enum Read {
    Tag(Tag),
    /// The tag does not end within the buffer yet.
    Incomplete,
}

/// Reads a tag name and its attributes, honouring quoted values (a `>` or `<` inside quotes
/// belongs to the value). `name_at` is where the name starts.
pub fn read_tag(buf: &[u8], name_at: usize) -> Read {
    let mut id = None;
    let walked = walk_tag(buf, name_at, |attribute, value| {
        if id.is_none() && attribute.eq_ignore_ascii_case(b"id") {
            id = Some(value);
        }
    });
    match walked {
        Some(Walked {
            name_end,
            end,
            self_closing,
        }) => Read::Tag(Tag {
            name: TagName::lowercase(&buf[name_at..name_end]),
            end,
            self_closing,
            id,
        }),
        None => Read::Incomplete,
    }
}

/// Where a tag's name ends and the tag itself ends (just past `>`).
#[derive(Clone, Copy)]
pub struct Walked {
    pub name_end: usize,
    pub end: usize,
    pub self_closing: bool,
}

/// Walks a tag from its name at `name_at` to its `>`, as HTML's tokenizer reads it (quoted
/// values may hold `>` and `<`), telling `on_value` each attribute name and its value's range.
/// `None`: the tag does not end within `buf` yet. Removing a module reads each of its tags
/// this way, without building a [`Tag`] it would not use.
#[inline]
pub fn walk_tag(
    buf: &[u8],
    name_at: usize,
    mut on_value: impl FnMut(&[u8], (usize, usize)),
) -> Option<Walked> {
    let mut i = name_at;
    while i < buf.len() && !(buf[i].is_ascii_whitespace() || buf[i] == b'>' || buf[i] == b'/') {
        i += 1;
    }
    if i >= buf.len() {
        return None;
    }
    let name_end = i;
    let mut self_closing = false;
    loop {
        while i < buf.len() && buf[i].is_ascii_whitespace() {
            i += 1;
        }
        let &byte = buf.get(i)?;
        match byte {
            b'>' => {
                return Some(Walked {
                    name_end,
                    end: i + 1,
                    self_closing,
                })
            }
            b'/' => {
                self_closing = buf.get(i + 1) == Some(&b'>');
                i += 1;
                continue;
            }
            _ => {}
        }
        self_closing = false;
        // An attribute name: up to whitespace, `=`, `>` or `/` (a leading `=` is part of it).
        let name_start = i;
        i += 1;
        while i < buf.len()
            && !(buf[i].is_ascii_whitespace() || matches!(buf[i], b'=' | b'>' | b'/'))
        {
            i += 1;
        }
        let attribute = &buf[name_start..i.min(buf.len())];
        while i < buf.len() && buf[i].is_ascii_whitespace() {
            i += 1;
        }
        if i >= buf.len() {
            return None;
        }
        if buf[i] != b'=' {
            continue;
        }
        i += 1;
        while i < buf.len() && buf[i].is_ascii_whitespace() {
            i += 1;
        }
        let &first = buf.get(i)?;
        let value = if first == b'"' || first == b'\'' {
            let close = next_byte(buf, i + 1, first)?;
            let value = (i + 1, close);
            i = value.1 + 1;
            value
        } else {
            let start = i;
            while i < buf.len() && !(buf[i].is_ascii_whitespace() || buf[i] == b'>') {
                i += 1;
            }
            if i >= buf.len() {
                return None;
            }
            (start, i)
        };
        on_value(attribute, value);
    }
}

/// What the scanner made of a needle found in the page.
#[derive(Debug, PartialEq, Eq)]
pub enum Found {
    /// The tag that may hold the needle starts at `start` and does not end within the buffer.
    Incomplete { start: usize },
    /// The needle is not the id of an element the selectors pick: pass the page on up to
    /// `resume` and keep looking.
    NotHere { resume: usize },
    /// The start tag at `start` is a selected element; `tag.end` is where its content begins.
    Element { start: usize, tag: Tag },
    /// Something the scanner does not handle: let the rewriter take over from `start`.
    Unsure { start: usize },
}

/// The tag that holds a position of the buffer, as far as the bytes before it show.
#[derive(Debug, PartialEq, Eq)]
pub enum Holder {
    /// No tag: the position is in text.
    None,
    /// The tag starting at `start` holds it and does not end within the buffer.
    Incomplete {
        start: usize,
    },
    Tag {
        start: usize,
        tag: Tag,
    },
}

/// How many tags `holder` reads back. Nothing short of parsing the page from its start tells
/// for sure that a `<` is not inside an earlier tag's value (`<div title="<b>x</b>" ...`: no
/// quote lies between `<b>` and what follows, yet the value is still open), so the walk is
/// bounded by count: a module whose start tag holds more `<` than this in its values before
/// its id is not recognised, and passes untouched.
const TAGS_READ_BACK: usize = 8;

/// Finds the tag that holds `buf[at]` by reading tags back from it. The last `<` before a
/// position is not always its tag's start: a quoted value may hold a `<` of its own
/// (`<div title="<b>x</b>" id="ranking">`), and what looks like a tag may itself sit in an
/// earlier tag's value (`<i title="<div id=ranking>">`). So each of the last few `<` that
/// open a tag is read forward, honouring quotes, and the earliest one whose tag reaches past
/// the position (or past the buffer) wins.
pub fn holder(buf: &[u8], at: usize) -> Holder {
    holder_walk(buf, at).0
}

/// [`holder`], and whether its answer stands whatever bytes come before `buf`: `false` when
/// the walk back ran out of buffer before it stopped on its own, so a `<` earlier in the page
/// could still change the answer.
pub fn holder_walk(buf: &[u8], at: usize) -> (Holder, bool) {
    // The tag found so far: where it starts, and whether it ends within `buf`. Tags are walked
    // without reading their names and ids, which only the one found needs (at chunk ends the
    // walk reads a few tags back, and usually finds none).
    let mut found: Option<(usize, bool)> = None;
    // The position the next tag back must reach past to hold what was found so far.
    let mut target = at;
    let mut before = at;
    let mut read = 0;
    while let Some(start) = memchr::memrchr(b'<', &buf[..before]) {
        before = start;
        if ends_raw_text(&buf[start..]) {
            // What came before may be script or style text, where a `<` opens nothing.
            return (holder_of(buf, found), true);
        }
        if !buf.get(start + 1).is_some_and(u8::is_ascii_alphabetic) {
            continue;
        }
        read += 1;
        if read > TAGS_READ_BACK {
            return (holder_of(buf, found), true);
        }
        let ends = match walk_tag(buf, start + 1, |_, _| {}) {
            None => false,
            Some(walked) if walked.end > target => true,
            Some(_) => continue,
        };
        // A tag read across a comment's end is not trusted: its `<` is most likely inside that
        // comment (`<!-- <div title="old --><div id="ranking">`), and HTML gives a `-->` in a
        // quoted value no reason to be there.
        if memchr::memmem::find(&buf[start..target], b"-->").is_some() {
            return (holder_of(buf, found), true);
        }
        found = Some((start, ends));
        target = start;
    }
    (holder_of(buf, found), false)
}

/// The [`Holder`] a walk back found (its start, and whether it ends): a tag that ends is read
/// again whole, name and id, by `read_tag`, which walks it as the walk back did.
fn holder_of(buf: &[u8], found: Option<(usize, bool)>) -> Holder {
    match found {
        None => Holder::None,
        Some((start, true)) => match read_tag(buf, start + 1) {
            Read::Tag(tag) => Holder::Tag { start, tag },
            Read::Incomplete => Holder::Incomplete { start },
        },
        Some((start, false)) => Holder::Incomplete { start },
    }
}

/// Elements whose text is not markup (raw-text and escapable raw-text elements, and
/// `noscript`, raw text where scripts run, as in every browser that matters here): their end
/// tag bounds how far back `holder` reads, and their text holds no module.
const RAW_TEXT: &[&[u8]] = &[
    b"script",
    b"style",
    b"textarea",
    b"title",
    b"xmp",
    b"iframe",
    b"noembed",
    b"noframes",
    b"noscript",
];

/// Does `rest` begin with the end tag of an element whose text is not markup?
fn ends_raw_text(rest: &[u8]) -> bool {
    rest.get(1) == Some(&b'/')
        && RAW_TEXT
            .iter()
            .any(|name| end_tag_named(rest, name) == Some(true))
}

/// Does `rest` begin with `name`'s end tag (`</script>`, `</SCRIPT `)? `None`: `rest` ends
/// before that can be told.
fn end_tag_named(rest: &[u8], name: &[u8]) -> Option<bool> {
    let Some(tail) = rest.strip_prefix(b"</") else {
        return Some(false);
    };
    let after = *tail.get(name.len())?;
    Some(tail[..name.len()].eq_ignore_ascii_case(name) && ends_tag_name(after))
}

/// Does `byte` end a tag's name (HTML's tag name state: whitespace, `/` or `>`)?
fn ends_tag_name(byte: u8) -> bool {
    matches!(byte, b'>' | b'/' | b' ' | b'\t' | b'\n' | b'\r' | b'\x0c')
}

/// Where the page's bytes read so far leave HTML's tokenizer, as far as hiding needs it: in
/// markup, or inside a comment or an element whose text is not markup (`<script>`, `<style>`,
/// `<title>`, `<textarea>` …). A module's start tag or marker found inside one of those is
/// text (`$('body').append('<div id="ranking">')`, a commented-out `<!-- <div id="ranking"> -->`
/// of an old template): taken for the module, it would have cut the rest of the page.
///
/// Read forward over every byte the scan passes on: in markup from one `<` to the next (a
/// word at a time, most `<` dismissed by the byte after them), in a comment or raw text
/// straight to its end. What it misplaces errs to the safe side: a `<script` inside an
/// attribute value reads as a script, so a module after it is left in place until `</script`,
/// never a page cut short.
#[derive(Debug, Clone, Default)]
pub struct TokenizerState {
    inside: Inside,
    /// The last bytes of what was fed, when they may begin something the next bytes finish
    /// (`<scr`, `--`): at most a dozen.
    pending: Vec<u8>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Inside {
    #[default]
    Markup,
    Comment,
    /// The lower-case name of the raw-text element whose end tag ends it.
    RawText(&'static [u8]),
    /// A `<script>`'s text, whose end HTML looks for otherwise than other raw text's.
    Script(ScriptText),
    /// `<plaintext>`: text to the end of the page.
    Plaintext,
}

/// Where in a script's text HTML's tokenizer is (WHATWG HTML 13.2.5.4 to 13.2.5.31, the
/// script data states, with the dash and less-than states folded into looking ahead). A
/// script that writes `<!--` keeps a `<script>` and `</script>` pair written inside it from
/// ending it (`<script><!-- document.write("<script></script>"); //--></script>`): ended at
/// the first `</script`, the scan took markup in the script's strings for the page's, and cut
/// a module out of the middle of the script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ScriptText {
    /// Script data: `</script` ends it, `<!--` escapes it.
    Plain,
    /// Script data escaped: `</script` ends it, `<script` double-escapes it, `-->` unescapes.
    Escaped,
    /// Script data double escaped: `</script` goes back to escaped, `-->` unescapes.
    DoubleEscaped,
}

/// The longest name worth reading after a `<` (`plaintext`), and one byte more.
const LONGEST_RAW_NAME: usize = 10;

/// What a `<` at the start of `rest` opens.
enum Opens {
    /// `rest` ends before that can be told.
    NeedMore,
    Comment,
    RawText(&'static [u8]),
    Plaintext,
    /// A tag or anything else that leaves the tokenizer in markup.
    Markup,
}

/// Bytes that may follow the `<` of a comment or of a raw-text element's start tag: `!` and
/// the first letters of their names. Any other `<` is dismissed at once.
const MAY_OPEN: [bool; 256] = {
    let mut table = [false; 256];
    let firsts = b"!sStTxXiInNpP";
    let mut i = 0;
    while i < firsts.len() {
        table[firsts[i] as usize] = true;
        i += 1;
    }
    table
};

/// The position of the first `<` in `buf` from `from`, read eight bytes at a time: most of a
/// page's `<` are a few dozen bytes apart, where a vector search's start-up costs more than
/// the search.
fn next_lt(buf: &[u8], from: usize) -> Option<usize> {
    next_byte(buf, from, b'<')
}

/// The position of the first `byte` in `buf` from `from`, read eight bytes at a time (see
/// [`next_lt`]; the closing quote of an attribute's value is a few bytes on, too).
#[inline]
fn next_byte(buf: &[u8], from: usize, byte: u8) -> Option<usize> {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    let pattern = u64::from_ne_bytes([byte; 8]);
    let mut at = from;
    while let Some(word) = buf.get(at..at + 8) {
        let word = u64::from_le_bytes(word.try_into().ok()?);
        let zeroed = word ^ pattern;
        // The lowest byte equal to `byte` is exactly the lowest flagged (a borrow only flags
        // bytes above a real one).
        let flagged = zeroed.wrapping_sub(ONES) & !zeroed & HIGHS;
        if flagged != 0 {
            return Some(at + (flagged.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    buf.get(at..)?
        .iter()
        .position(|&found| found == byte)
        .map(|found| at + found)
}

fn opens(rest: &[u8]) -> Opens {
    match rest.get(1) {
        None => Opens::NeedMore,
        Some(&next) if !MAY_OPEN[usize::from(next)] => Opens::Markup,
        Some(b'!') => match rest.get(..4) {
            None if b"<!--".starts_with(rest) => Opens::NeedMore,
            Some(b"<!--") => Opens::Comment,
            _ => Opens::Markup,
        },
        Some(first) if first.is_ascii_alphabetic() => {
            let name_len = rest[1..]
                .iter()
                .take(LONGEST_RAW_NAME + 1)
                .take_while(|byte| byte.is_ascii_alphanumeric())
                .count();
            if name_len > LONGEST_RAW_NAME {
                return Opens::Markup;
            }
            let Some(&after) = rest.get(1 + name_len) else {
                return Opens::NeedMore;
            };
            if !ends_tag_name(after) {
                return Opens::Markup;
            }
            let name = &rest[1..1 + name_len];
            if name.eq_ignore_ascii_case(b"plaintext") {
                return Opens::Plaintext;
            }
            RAW_TEXT
                .iter()
                .find(|raw| raw.len() == name_len && name.eq_ignore_ascii_case(raw))
                .map_or(Opens::Markup, |raw| Opens::RawText(raw))
        }
        Some(_) => Opens::Markup,
    }
}

impl TokenizerState {
    /// Reads `bytes`, which follow everything fed before.
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.pending.is_empty() {
            let read = self.advance(bytes);
            self.pending.extend_from_slice(&bytes[read..]);
        } else {
            let mut joined = std::mem::take(&mut self.pending);
            joined.extend_from_slice(bytes);
            let read = self.advance(&joined);
            joined.drain(..read);
            self.pending = joined;
        }
    }

    /// Whether the bytes fed so far, followed by `next`, leave the tokenizer in markup: where
    /// a module's start tag (or marker) that begins right after them is one.
    pub fn in_markup_after(&self, next: &[u8]) -> bool {
        let mut probe = self.clone();
        probe.feed(next);
        // What is still pending opens nothing yet: a tag starts where the caller stands.
        probe.inside == Inside::Markup
    }

    /// Reads as far into `buf` as can be told; returns how many bytes that was (the rest may
    /// begin something the next bytes finish).
    fn advance(&mut self, buf: &[u8]) -> usize {
        let mut at = 0;
        loop {
            match self.inside {
                Inside::Markup => {
                    let Some(lt) = next_lt(buf, at) else {
                        return buf.len();
                    };
                    match opens(&buf[lt..]) {
                        Opens::NeedMore => return lt,
                        Opens::Markup => at = lt + 1,
                        // `<!-->` is a whole (empty) comment: its end is looked for from `--`.
                        Opens::Comment => {
                            self.inside = Inside::Comment;
                            at = lt + 2;
                        }
                        Opens::RawText(name) => {
                            self.inside = if name == b"script" {
                                Inside::Script(ScriptText::Plain)
                            } else {
                                Inside::RawText(name)
                            };
                            at = lt + 1 + name.len();
                        }
                        Opens::Plaintext => {
                            self.inside = Inside::Plaintext;
                            return buf.len();
                        }
                    }
                }
                Inside::Comment => match memchr::memmem::find(&buf[at..], b"-->") {
                    Some(end) => {
                        self.inside = Inside::Markup;
                        at += end + 3;
                    }
                    None => return buf.len().saturating_sub(2).max(at),
                },
                Inside::RawText(name) => {
                    let mut from = at;
                    loop {
                        let Some(found) = memchr::memmem::find(&buf[from..], b"</") else {
                            return buf.len().saturating_sub(1).max(from);
                        };
                        let lt = from + found;
                        match end_tag_named(&buf[lt..], name) {
                            None => return lt,
                            Some(true) => {
                                self.inside = Inside::Markup;
                                at = lt + 2 + name.len();
                                break;
                            }
                            Some(false) => from = lt + 2,
                        }
                    }
                }
                Inside::Script(text) => match script_text(buf, at, text) {
                    ScriptStep::NeedMore(from) => return from,
                    ScriptStep::Goes(next, from) => {
                        self.inside = next.map_or(Inside::Markup, Inside::Script);
                        at = from;
                    }
                },
                Inside::Plaintext => return buf.len(),
            }
        }
    }
}

/// What the next bytes of a script's text that matter do.
enum ScriptStep {
    /// The text reaches the end of the buffer, from this offset on perhaps something the next
    /// bytes finish (`</scr`, `--`).
    NeedMore(usize),
    /// The tokenizer goes to this state (`None`: out of the script, into markup), reading on
    /// from this offset.
    Goes(Option<ScriptText>, usize),
}

/// Reads a script's text in `buf` from `at`, in state `text`, up to the first byte that changes
/// the state (or to the end of the buffer).
fn script_text(buf: &[u8], at: usize, text: ScriptText) -> ScriptStep {
    let mut from = at;
    loop {
        let found = match text {
            // Only a `<` matters in plain script data.
            ScriptText::Plain => next_lt(buf, from),
            ScriptText::Escaped | ScriptText::DoubleEscaped => {
                memchr::memchr2(b'<', b'-', &buf[from..]).map(|found| from + found)
            }
        };
        let Some(at) = found else {
            return ScriptStep::NeedMore(buf.len());
        };
        let rest = &buf[at..];
        if rest[0] == b'-' {
            // `-->`, the last dashes of any run of them, leaves the escaped states.
            if rest.starts_with(b"-->") {
                return ScriptStep::Goes(Some(ScriptText::Plain), at + 3);
            }
            if b"-->".starts_with(rest) {
                return ScriptStep::NeedMore(at);
            }
            from = at + 1;
            continue;
        }
        let end_tag = script_tag(rest, b"</");
        let past_end = at + b"</script".len();
        let step = match text {
            ScriptText::Plain if rest.starts_with(b"<!--") => {
                // In the escaped dash dash state: `<!-->` unescapes at once.
                Some(ScriptStep::Goes(Some(ScriptText::Escaped), at + 2))
            }
            ScriptText::Plain if rest.len() < 4 && b"<!--".starts_with(rest) => {
                Some(ScriptStep::NeedMore(at))
            }
            ScriptText::Plain => end_tag.step(at, ScriptStep::Goes(None, past_end)),
            ScriptText::Escaped => match (end_tag, script_tag(rest, b"<")) {
                (Spelled::Yes, _) => Some(ScriptStep::Goes(None, past_end)),
                (_, Spelled::Yes) => Some(ScriptStep::Goes(
                    Some(ScriptText::DoubleEscaped),
                    at + b"<script".len(),
                )),
                (Spelled::Unknown, _) | (_, Spelled::Unknown) => Some(ScriptStep::NeedMore(at)),
                (Spelled::No, Spelled::No) => None,
            },
            ScriptText::DoubleEscaped => {
                end_tag.step(at, ScriptStep::Goes(Some(ScriptText::Escaped), past_end))
            }
        };
        match step {
            Some(step) => return step,
            None => from = at + 1,
        }
    }
}

/// Whether some bytes spell a tag.
#[derive(Clone, Copy)]
enum Spelled {
    Yes,
    No,
    /// They end before that can be told.
    Unknown,
}

impl Spelled {
    /// The step a tag at `at` makes: `then` if it is spelled, none if not, or wait for more.
    fn step(self, at: usize, then: ScriptStep) -> Option<ScriptStep> {
        match self {
            Spelled::Yes => Some(then),
            Spelled::No => None,
            Spelled::Unknown => Some(ScriptStep::NeedMore(at)),
        }
    }
}

/// Whether `rest` begins with `opening` (`<` or `</`) and `script` (any case) followed by what
/// ends a tag name.
fn script_tag(rest: &[u8], opening: &[u8]) -> Spelled {
    const NAME: &[u8] = b"script";
    let len = opening.len() + NAME.len();
    let spelled = rest.iter().take(len).enumerate().all(|(at, byte)| {
        let wanted = opening.get(at).unwrap_or_else(|| &NAME[at - opening.len()]);
        byte.to_ascii_lowercase() == *wanted
    });
    if !spelled {
        return Spelled::No;
    }
    match rest.get(len) {
        None => Spelled::Unknown,
        Some(&after) if ends_tag_name(after) => Spelled::Yes,
        Some(_) => Spelled::No,
    }
}

/// Looks at the needle found at `at` (length `len`) in `buf`: is it inside a start tag, as
/// the id one of `selectors` picks?
pub fn judge(buf: &[u8], at: usize, len: usize, selectors: &[IdSelector]) -> Found {
    let (start, tag) = match holder(buf, at) {
        Holder::None => return Found::NotHere { resume: at + len },
        Holder::Incomplete { start } => return Found::Incomplete { start },
        Holder::Tag { start, tag } => (start, tag),
    };
    let picked = tag.id.is_some_and(|(from, to)| {
        selectors.iter().any(|selector| {
            selector.id == buf[from..to]
                && selector.tag.as_ref().is_none_or(|name| **name == *tag.name)
        })
    });
    if !picked {
        // The whole tag is passed: a needle later in it is in the same tag, not in a new one.
        return Found::NotHere {
            resume: tag.end.max(at + len),
        };
    }
    if is_cut_whole(&tag.name) {
        Found::Element { start, tag }
    } else {
        Found::Unsure { start }
    }
}

/// Progress of removing one element whose start tag has been read.
#[derive(Debug)]
pub struct Cut {
    /// The removed element's (lower-case) name.
    removed: TagName,
    /// The elements open inside the removed one, which is first. An end tag closes the
    /// innermost open element of its name and everything opened after it, as the rewriter's
    /// own stack does, so a module with an unclosed `<span>` or `<li>` ends where the
    /// rewriter would end it.
    open: Vec<OpenName>,
    /// The names of open elements too long for an inline [`OpenName`] (custom elements).
    long_names: Vec<Vec<u8>>,
    /// Where scanning continues in the held bytes.
    pub cursor: usize,
    /// How the removed element ends when its end tag is left out, if HTML allows that.
    optional: Option<OptionalEnd>,
    /// How a start tag of its own kind ends the removed element, if one does.
    ended_by_kind: Option<KindEnd>,
    /// An end tag that matched nothing open inside and that HTML may have ended the element
    /// with, while nothing yet said whether it did (see [`Cut::end_tag`]).
    stray: Option<Stray>,
}

/// An end tag inside a removed element that matched nothing open inside it.
#[derive(Debug, Clone, Copy)]
struct Stray {
    /// Where it starts.
    at: usize,
    /// How many elements were open (the removed one first) when it came: an element closed
    /// later at an index below this was open across it.
    open_then: usize,
}

/// How a start tag of their own kind ends the elements of [`ENDED_BY_THEIR_KIND`] and headings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KindEnd {
    /// `<a>`, `<button>`, `<nobr>`: another of the same name ends it, whatever is open inside
    /// it, unless that is a cell, a caption or the like (a `<button>` in a table cell of the
    /// button is the cell's own).
    SameName,
    /// Headings: any heading's start tag ends it when nothing is open inside it (HTML pops
    /// a heading that is the current node).
    Heading,
}

impl Cut {
    pub fn new(name: TagName, cursor: usize) -> Cut {
        let mut long_names = Vec::new();
        let removed = open_name(&mut long_names, &name);
        let ended_by_kind = if is_one_of(&name, HEADINGS) {
            Some(KindEnd::Heading)
        } else if is_one_of(&name, ENDED_BY_THEIR_KIND) {
            Some(KindEnd::SameName)
        } else {
            None
        };
        Cut {
            optional: optional_end(&name),
            ended_by_kind,
            removed: name,
            open: vec![removed],
            long_names,
            cursor,
            stray: None,
        }
    }

    /// Where the element ends if its own end tag never comes: before an end tag that matched
    /// nothing open inside it and that HTML may have closed it with (`</td>` around a
    /// `<div id=m>` whose `</div>` is missing). `None` when there was none.
    pub fn first_stray(&self) -> Option<usize> {
        self.stray.map(|stray| stray.at)
    }

    /// Closes the elements open inside from `index` on. One that was open across a pending
    /// stray end tag shows the tag did not end the removed element (HTML had closed it with
    /// the removed one): the tag was ignored.
    fn close_inside(&mut self, index: usize) {
        if self.stray.is_some_and(|stray| index < stray.open_then) {
            self.stray = None;
        }
        self.open.truncate(index);
        self.forget_closed_long_names();
    }

    /// The removed element's own end tag, ending at `end`: it ends there, unless a stray end
    /// tag came before it that nothing since showed to be ignored, which then ended it (a
    /// `</td>` around a `<div id=m>` missing its `</div>`, whose `</div>` here is a `<div>`'s
    /// of the page around the table).
    fn own_end(&self, end: usize) -> Step {
        Step::Ended(self.stray.map_or(end, |stray| stray.at))
    }

    /// Drops the long names of elements no longer open, so that a module of many closed
    /// custom elements holds no more names than are open. Long names are kept in the order
    /// their elements opened, so those still open are the first few.
    fn forget_closed_long_names(&mut self) {
        if self.long_names.is_empty() {
            return;
        }
        let still_open = self
            .open
            .iter()
            .rev()
            .find_map(|open| open.long_index())
            .map_or(0, |index| index + 1);
        self.long_names.truncate(still_open);
    }

    /// Whether the open element `open` is named `name` (any case).
    fn is_named(&self, open: OpenName, inline: Option<OpenName>, name: &[u8]) -> bool {
        match (inline, open.long_index()) {
            (Some(inline), _) => open == inline,
            (None, Some(index)) => self
                .long_names
                .get(index)
                .is_some_and(|long| long.eq_ignore_ascii_case(name)),
            (None, None) => false,
        }
    }

    /// What the start tag `name` does to a removed element whose end tag may be left out:
    /// `Some` ends the cut (or gives up), `None` lets the tag open inside it.
    fn start_ends(&self, name: &[u8], at: usize) -> Option<Step> {
        let optional = self.optional.as_ref()?;
        if name == b"table" && *self.removed == *b"p" {
            // Not in P_CLOSING_STARTS, but a `<table>` does end a `<p>` outside quirks mode;
            // which mode the page is in is not known here.
            return Some(Step::GiveUp);
        }
        if !is_one_of(name, optional.starts) {
            return None;
        }
        let inside = &self.open[1..];
        if inside.is_empty() {
            return Some(Step::Ended(at));
        }
        if inside.iter().any(|open| open.is_one_of(optional.nests)) {
            // A list or table of its own inside the element: the tag is nested in it.
            return None;
        }
        Some(if optional.closes_inner {
            Step::Ended(at)
        } else {
            Step::GiveUp
        })
    }

    /// What the start tag `name` (lower case) does to a removed element that a start tag of its
    /// own kind ends: `Some` ends it, `None` lets the tag open inside it.
    fn kind_start_ends(&self, kind: KindEnd, name: &[u8], at: usize) -> Option<Step> {
        let inside = &self.open[1..];
        let ends = match kind {
            KindEnd::SameName => {
                *name == *self.removed && !inside.iter().any(|open| open.is_one_of(DEFAULT_SCOPE))
            }
            KindEnd::Heading => is_one_of(name, HEADINGS) && inside.is_empty(),
        };
        ends.then_some(Step::Ended(at))
    }

    /// What the end tag `name` (as written; `inline`, its inline word when it has one), from
    /// `at` to `end`, does: `Some` ends the removed element, `None` goes on (having closed
    /// what it closes inside). Elements open inside are closed as HTML closes them: the
    /// innermost one of its name (any heading for a heading's end tag) and what was opened
    /// after it, not past a scope boundary for end tags HTML looks up in scope.
    fn end_tag(
        &mut self,
        name: &[u8],
        inline: Option<OpenName>,
        at: usize,
        end: usize,
    ) -> Option<Step> {
        // Most end tags close the innermost open element: no scope to look through, and no
        // lower-casing of the name (a module of well-formed markup cost a fifth more to cut
        // without this).
        if let Some(&innermost) = self.open.last() {
            if self.is_named(innermost, inline, name) {
                let index = self.open.len() - 1;
                if index == 0 {
                    return Some(self.own_end(end));
                }
                self.close_inside(index);
                return None;
            }
        }
        let lower = TagName::lowercase(name);
        let heading = is_one_of(&lower, HEADINGS);
        let matches = |cut: &Cut, open: OpenName| {
            if heading {
                open.is_one_of(HEADINGS)
            } else {
                cut.is_named(open, inline, name)
            }
        };
        let rule = end_rule(&lower);
        let mut bounded = false;
        for index in (0..self.open.len()).rev() {
            let open = self.open[index];
            if matches(self, open) {
                if index == 0 {
                    // Also when a boundary lies in between (`<div id=m><table><tr><td>a</div>`,
                    // which HTML ignores): the element ends here, less than HTML removes, as
                    // the scanner always ended it.
                    return Some(self.own_end(end));
                }
                if !bounded {
                    self.close_inside(index);
                }
                // Past a boundary HTML ignores it.
                return None;
            }
            if let EndRule::InScope(bounds) = rule {
                bounded |= open.is_one_of(bounds);
            }
        }
        // It matches nothing open inside.
        if self.optional.is_some() {
            return self.end_ends(&lower, at);
        }
        // HTML closes the removed element with it when its element is open around the removed
        // one (`<td><div id=m>…</td>`, a `</div>` around a `<span id=m>`); when nothing around
        // matches, HTML ignores it and the element goes on (a stray `</li>` in a template).
        // Which is the case is not known here (what is open around the element is not read),
        // so the scan runs on and what follows decides: an element open across the tag closing
        // after it (`<span>A</li>B</span>`) says it was ignored; the removed element's own end
        // tag, or a second such tag, coming first says it ended the element there (what came
        // after it is the page around: a `</div>` of a wrapper is not the element's own), as
        // does the page ending or the hold's bound. Ended, not run over to the next `</div>`:
        // a misread leaves the rest of a broken module in place, never takes what follows
        // it. Ignored for sure, so no such place: an end tag HTML looks up in scope with a
        // boundary open (`</li>` in a `<ul id=m>`), any other with a special element open
        // (`</span>` in a `<div id=m>`), and those that close nothing open after their own
        // element.
        let may_end_here = match rule {
            EndRule::InScope(bounds) => !self.open.iter().any(|open| open.is_one_of(bounds)),
            EndRule::Other => !self.open.iter().any(|open| open.is_one_of(SPECIAL)),
            EndRule::Kept => false,
        };
        if !may_end_here {
            return None;
        }
        match self.stray {
            Some(stray) => Some(Step::Ended(stray.at)),
            None => {
                self.stray = Some(Stray {
                    at,
                    open_then: self.open.len(),
                });
                None
            }
        }
    }

    /// What the end tag `name`, matching nothing open inside, does to a removed element whose
    /// end tag may be left out (`None`: it is ignored, as HTML ignores a stray end tag).
    fn end_ends(&self, name: &[u8], at: usize) -> Option<Step> {
        let optional = self.optional.as_ref()?;
        if !optional.ended_by(name, &self.removed) {
            return None;
        }
        let inside = &self.open[1..];
        Some(
            if inside.is_empty()
                || (optional.closes_inner
                    && !inside.iter().any(|open| open.is_one_of(optional.nests)))
            {
                Step::Ended(at)
            } else {
                Step::GiveUp
            },
        )
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// The element ends just before this offset.
    Ended(usize),
    /// Need more of the page.
    More,
    /// Content the scanner cannot count tags in: hand everything held to the rewriter.
    GiveUp,
}

impl Cut {
    /// Scans `held` (which starts with the removed element's start tag) from the cursor.
    pub fn advance(&mut self, held: &[u8]) -> Step {
        loop {
            let Some(at) = next_lt(held, self.cursor) else {
                self.cursor = held.len();
                return Step::More;
            };
            let Some(&next) = held.get(at + 1) else {
                self.cursor = at;
                return Step::More;
            };
            match next {
                b'!' => {
                    let rest = &held[at..];
                    if rest.len() < 4 {
                        self.cursor = at;
                        return Step::More;
                    }
                    if !rest.starts_with(b"<!--") {
                        if rest.len() >= 9 && rest[..9].eq_ignore_ascii_case(b"<![cdata[") {
                            return Step::GiveUp;
                        }
                        if rest.starts_with(b"<![") && rest.len() < 9 {
                            self.cursor = at;
                            return Step::More;
                        }
                        // A doctype or bogus comment: it ends at the next `>`.
                        match memchr::memchr(b'>', rest) {
                            Some(end) => self.cursor = at + end + 1,
                            None => {
                                self.cursor = at;
                                return Step::More;
                            }
                        }
                        continue;
                    }
                    // `<!-->` and `<!--->` are complete (empty) comments.
                    let body = &rest[4..];
                    if body.starts_with(b">") {
                        self.cursor = at + 5;
                    } else if body.starts_with(b"->") {
                        self.cursor = at + 6;
                    } else if body.is_empty() || body == b"-" {
                        self.cursor = at;
                        return Step::More;
                    } else {
                        match memchr::memmem::find(body, b"-->") {
                            Some(end) => self.cursor = at + 4 + end + 3,
                            None => {
                                self.cursor = at;
                                return Step::More;
                            }
                        }
                    }
                }
                b'?' => match memchr::memchr(b'>', &held[at..]) {
                    Some(end) => self.cursor = at + end + 1,
                    None => {
                        self.cursor = at;
                        return Step::More;
                    }
                },
                b'/' => {
                    let Some(&first) = held.get(at + 2) else {
                        self.cursor = at;
                        return Step::More;
                    };
                    if !first.is_ascii_alphabetic() {
                        // `</>` is dropped, `</ ...>` is a bogus comment: both end at `>`.
                        match memchr::memchr(b'>', &held[at..]) {
                            Some(end) => self.cursor = at + end + 1,
                            None => {
                                self.cursor = at;
                                return Step::More;
                            }
                        }
                        continue;
                    }
                    let Some(tag) = walk_tag(held, at + 2, |_, _| {}) else {
                        self.cursor = at;
                        return Step::More;
                    };
                    self.cursor = tag.end;
                    let name = &held[at + 2..tag.name_end];
                    let inline = OpenName::inline_at(held, at + 2, name.len());
                    if let Some(step) = self.end_tag(name, inline, at, tag.end) {
                        return step;
                    }
                }
                letter if letter.is_ascii_alphabetic() => {
                    let Some(tag) = walk_tag(held, at + 1, |_, _| {}) else {
                        self.cursor = at;
                        return Step::More;
                    };
                    self.cursor = tag.end;
                    let name_len = tag.name_end - (at + 1);
                    // The name lower-cased as a word when it is short (the usual case): told
                    // apart from the names that matter by comparing words, and pushed whole.
                    let Some(open) = OpenName::inline_at(held, at + 1, name_len) else {
                        // A long (custom) name: no element the scanner reacts to, void, not
                        // markup or ending the removed one, has a name this long. It opens.
                        let name = held[at + 1..tag.name_end].to_ascii_lowercase();
                        let open = open_name(&mut self.long_names, &name);
                        self.open.push(open);
                        continue;
                    };
                    if self.optional.is_some() {
                        let bytes = open.0.to_le_bytes();
                        if let Some(step) = self.start_ends(&bytes[..name_len], at) {
                            return step;
                        }
                    } else if let Some(kind) = self.ended_by_kind {
                        let bytes = open.0.to_le_bytes();
                        if let Some(step) = self.kind_start_ends(kind, &bytes[..name_len], at) {
                            return step;
                        }
                    }
                    match open.kind() {
                        NameKind::NotMarkup => return Step::GiveUp,
                        // `/>` does not close a non-void HTML element; void ones never open.
                        NameKind::Void => {}
                        NameKind::Other => self.open.push(open),
                    }
                }
                // A `<` that starts no tag is text.
                _ => self.cursor = at + 1,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(list: &[&str]) -> Vec<IdSelector> {
        list.iter()
            .map(|s| IdSelector::parse(s).expect("id selector"))
            .collect()
    }

    #[test]
    fn id_selectors_parse_only_when_plain() {
        assert_eq!(
            IdSelector::parse("div#ranking"),
            Some(IdSelector {
                tag: Some(b"div".to_vec()),
                id: b"ranking".to_vec()
            })
        );
        assert!(IdSelector::parse("#a-b_c").is_some());
        for other in ["#", ".x", "div", "#a b", "#a:hover", "div.x#y", "#a,#b"] {
            assert_eq!(IdSelector::parse(other), None, "{other}");
        }
    }

    #[test]
    fn searching_a_word_at_a_time_finds_what_a_byte_loop_finds() {
        // Buffers drawn from bytes that look close to the ones sought, at every offset.
        let alphabet = b"ab/>< \t\n\x0b\x0c\r\0\x1f!\"'=\x80\xff?.";
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        for _ in 0..2_000 {
            let len = (state % 40) as usize;
            let buf: Vec<u8> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    alphabet[(state % alphabet.len() as u64) as usize]
                })
                .collect();
            for from in 0..=buf.len() {
                for byte in [b'<', b'"'] {
                    let next = buf[from..]
                        .iter()
                        .position(|&found| found == byte)
                        .map(|found| from + found);
                    assert_eq!(next_byte(&buf, from, byte), next, "{buf:?} from {from}");
                }
            }
        }
    }

    #[test]
    fn start_tag_names_are_told_apart_by_their_word_as_by_their_bytes() {
        // HTML's void elements, and those whose content the scanner cannot read as markup:
        // raw text, and elements that change how markup is read.
        const VOID: &[&[u8]] = &[
            b"area", b"base", b"br", b"col", b"embed", b"hr", b"img", b"input", b"link", b"meta",
            b"source", b"track", b"wbr",
        ];
        let not_markup: Vec<&[u8]> = RAW_TEXT
            .iter()
            .copied()
            .chain([&b"plaintext"[..], b"svg", b"math", b"template"])
            .collect();
        let expected = |name: &[u8]| {
            let lower = name.to_ascii_lowercase();
            if VOID.contains(&&lower[..]) {
                NameKind::Void
            } else if not_markup.contains(&&lower[..]) {
                NameKind::NotMarkup
            } else {
                NameKind::Other
            }
        };
        // Read from a page as the scanner reads it: with one load when 16 bytes follow, byte
        // by byte at the buffer's end.
        let kind = |raw: &[u8]| {
            let at_end = OpenName::inline_at(raw, 0, raw.len()).expect("inline");
            let page = [raw, b" class=x>0123456789"].concat();
            let in_page = OpenName::inline_at(&page, 0, raw.len()).expect("inline");
            assert_eq!(at_end, in_page, "{}", String::from_utf8_lossy(raw));
            assert_eq!(
                is_void(&raw.to_ascii_lowercase()),
                at_end.kind() == NameKind::Void
            );
            at_end.kind()
        };
        assert_eq!(KINDS.len(), VOID.len() + not_markup.len());
        for name in VOID.iter().chain(&not_markup) {
            assert_eq!(
                kind(name),
                expected(name),
                "{}",
                String::from_utf8_lossy(name)
            );
            assert_eq!(kind(&name.to_ascii_uppercase()), expected(name));
        }
        // Every name of up to three letters, and near misses of listed names.
        let letters = b"abcdefghijklmnopqrstuvwxyz";
        let mut names: Vec<Vec<u8>> = Vec::new();
        for &a in letters {
            names.push(vec![a]);
            for &b in letters {
                names.push(vec![a, b]);
                for &c in letters {
                    names.push(vec![a, b, c]);
                }
            }
        }
        for name in VOID.iter().chain(&not_markup) {
            names.push([*name, b"\0"].concat());
            names.push([*name, b"x"].concat());
            names.push(name[..name.len() - 1].to_vec());
        }
        names.push(b"plaintext-and-more".to_vec()[..15].to_vec());
        for name in &names {
            assert_eq!(
                kind(name),
                expected(name),
                "{}",
                String::from_utf8_lossy(name)
            );
        }
    }

    #[test]
    fn tag_names_are_lower_case_and_long_ones_kept_whole() {
        assert_eq!(&*TagName::lowercase(b"DiV"), b"div");
        // Every byte value, at two positions of the inline word and in names of every length,
        // lower-cased as `to_ascii_lowercase` does (non-ASCII bytes and `@`, `[`, `` ` ``,
        // `{` untouched).
        for first in (0..=255u8).step_by(16) {
            let raw: Vec<u8> = (first..=first.saturating_add(15)).collect();
            for len in 0..=raw.len() {
                assert_eq!(
                    &*TagName::lowercase(&raw[..len]),
                    &raw[..len].to_ascii_lowercase()[..]
                );
            }
            let mut reversed = raw.clone();
            reversed.reverse();
            assert_eq!(
                &*TagName::lowercase(&reversed),
                &reversed.to_ascii_lowercase()[..]
            );
        }
        // Inline up to 16 bytes, kept whole past that; equal names are equal either way.
        let sixteen = TagName::lowercase(b"SIXTEEN-BYTES-ON");
        assert!(matches!(sixteen, TagName::Short { .. }));
        assert_eq!(&*sixteen, b"sixteen-bytes-on");
        let seventeen = TagName::lowercase(b"seventeen-BYTES-x");
        assert!(matches!(seventeen, TagName::Long(_)));
        assert_eq!(&*seventeen, b"seventeen-bytes-x");
        assert_eq!(TagName::lowercase(b"Td"), TagName::lowercase(b"tD"));
        assert_ne!(TagName::lowercase(b"td"), TagName::lowercase(b"td\0"));
        // Read with one load where 16 bytes follow, byte by byte at the buffer's end: the same.
        let buf = b"<DIV class=x><Table><tR></TR></table></Div>";
        for start in 0..buf.len() {
            for len in 0..=16.min(buf.len() - start) {
                assert_eq!(
                    lowercase_word_at(buf, start, len),
                    lowercase_word(&buf[start..start + len]),
                    "{start} {len}"
                );
            }
        }
        let every_byte: Vec<u8> = (0..=255u8).chain(0..=255u8).collect();
        for start in 0..every_byte.len() {
            for len in 0..=16.min(every_byte.len() - start) {
                assert_eq!(
                    lowercase_word_at(&every_byte, start, len),
                    lowercase_word(&every_byte[start..start + len]),
                    "{start} {len}"
                );
            }
        }
        let long_a = TagName::lowercase(b"my-very-long-component-name-a");
        let long_b = TagName::lowercase(b"my-very-long-component-name-b");
        assert_eq!(&*long_a, b"my-very-long-component-name-a");
        assert_ne!(long_a, long_b);
        assert_eq!(long_a, TagName::lowercase(b"MY-very-long-component-name-A"));
        // A removed module with such elements inside ends at its own end tag.
        let held = b"<div id=m><my-very-long-component-name-a><div></div></MY-VERY-LONG-COMPONENT-NAME-A></div>tail";
        let Read::Tag(tag) = read_tag(held, 1) else {
            panic!("complete")
        };
        assert_eq!(
            Cut::new(tag.name, tag.end).advance(held),
            Step::Ended(held.len() - 4)
        );
    }

    #[test]
    fn tags_are_read_with_quoted_values() {
        let html = br#"<div title="a > b <c>" data-x=1 ID='rank' id="second">"#;
        let Read::Tag(tag) = read_tag(html, 1) else {
            panic!("complete")
        };
        assert_eq!(&*tag.name, b"div");
        assert_eq!(tag.end, html.len());
        let (from, to) = tag.id.expect("id");
        assert_eq!(&html[from..to], b"rank", "the first id attribute counts");
        for cut in 1..html.len() {
            assert_eq!(read_tag(&html[..cut], 1), Read::Incomplete, "cut at {cut}");
        }
    }

    #[test]
    fn judging_a_needle() {
        let selectors = ids(&["#ranking"]);
        let page = br#"<p>see the ranking</p><div class="box" id="ranking"><b>x</b></div>"#;
        let first = memchr::memmem::find(page, b"ranking").expect("needle");
        assert!(matches!(
            judge(page, first, 7, &selectors),
            Found::NotHere { .. }
        ));
        let second = first + 7 + memchr::memmem::find(&page[first + 7..], b"ranking").unwrap();
        match judge(page, second, 7, &selectors) {
            Found::Element { start, tag } => {
                assert_eq!(&page[start..start + 4], b"<div");
                assert_eq!(&*tag.name, b"div");
            }
            other => panic!("{other:?}"),
        }
        let wrong_tag = ids(&["span#ranking"]);
        assert!(matches!(
            judge(page, second, 7, &wrong_tag),
            Found::NotHere { .. }
        ));
        let script = br#"<script id="ranking">"#;
        assert!(matches!(
            judge(script, 12, 7, &selectors),
            Found::Unsure { start: 0 }
        ));
    }

    fn cut_all(held: &[u8]) -> Step {
        let Read::Tag(tag) = read_tag(held, 1) else {
            return Step::More;
        };
        Cut::new(tag.name, tag.end).advance(held)
    }

    #[test]
    fn nested_same_name_tags_comments_and_quotes_are_counted_right() {
        let module = br#"<div id="r"><div a="</div>">x</div><!-- </div> --><p>y</div>"#;
        let tail = b"<p>after</p>";
        let page = [&module[..], &tail[..]].concat();
        assert_eq!(cut_all(&page), Step::Ended(module.len()));
        // Fed a byte at a time, it reaches the same end.
        let Read::Tag(tag) = read_tag(&page, 1) else {
            panic!()
        };
        let mut cut = Cut::new(tag.name, tag.end);
        let mut ended = None;
        for len in tag.end..=page.len() {
            if let Step::Ended(end) = cut.advance(&page[..len]) {
                ended = Some(end);
                break;
            }
        }
        assert_eq!(ended, Some(module.len()));
        // Names in any case, and long (custom) names, are matched as HTML matches them: an end
        // tag closes the innermost open element of its name and what was opened after it.
        for module in [
            &br#"<DIV id="r"><Div><sPaN>x</SPAN></dIV></div>"#[..],
            br"<div id=r><my-very-long-element-a><my-very-long-element-b><span></MY-VERY-LONG-ELEMENT-A></div>",
            br"<div id=r><name-of-15-byte><name-of-16-bytes></NAME-OF-15-BYTE></div>",
            br"<div id=r><name-of-16-bytes><name-of-15-byte></NAME-OF-16-BYTES></div>",
            br"<div id=r><my-very-long-element-a><div></div></my-very-long-element-b></DIV>",
        ] {
            let page = [module, &tail[..]].concat();
            assert_eq!(
                cut_all(&page),
                Step::Ended(module.len()),
                "{}",
                String::from_utf8_lossy(module)
            );
        }
        // Closed long names are not kept: a module of many custom elements holds only the
        // names still open.
        let mut held = b"<div id=r>".to_vec();
        for _ in 0..1000 {
            held.extend_from_slice(b"<My-Custom-Element-Name><b>x</b></my-custom-element-name>");
        }
        held.extend_from_slice(b"<my-outer-custom-element><my-custom-element-name>");
        let Read::Tag(tag) = read_tag(&held, 1) else {
            panic!("complete")
        };
        let mut cut = Cut::new(tag.name, tag.end);
        assert_eq!(cut.advance(&held), Step::More);
        assert_eq!(cut.long_names.len(), 2);
        held.extend_from_slice(b"</MY-OUTER-CUSTOM-ELEMENT></div>");
        assert_eq!(cut.advance(&held), Step::Ended(held.len()));
        // A long name is not taken for a short one it begins with, nor the other way round.
        let module = br"<div id=r><div-of-a-long-name-here><div></div-of-a-long-name-here></div>";
        let page = [&module[..], b"</div>", &tail[..]].concat();
        assert_eq!(cut_all(&page), Step::Ended(module.len()));
    }

    #[test]
    fn raw_text_and_foreign_content_give_up() {
        for inner in [
            "<script>x</script>",
            "<style>a{}</style>",
            "<svg></svg>",
            "<![CDATA[x]]>",
        ] {
            let page = format!("<div id=r>{inner}</div>");
            assert_eq!(cut_all(page.as_bytes()), Step::GiveUp, "{inner}");
        }
        // `<div/>` opens a div like `<div>`; an unclosed inner element ends with the outer one.
        assert_eq!(cut_all(b"<div id=r><div/></div></div>x"), Step::Ended(28));
        assert_eq!(cut_all(b"<div id=r><span><li>a</div>x"), Step::Ended(27));
    }

    /// Where the cut of the element starting `held` ends, as the text left of the page.
    /// What follows the element in `held`, a whole page: where it ended, or, its own end
    /// tag not having come, where it may have ended (as at the end of a page).
    fn left_after_cut(held: &str) -> Option<String> {
        let Read::Tag(tag) = read_tag(held.as_bytes(), 1) else {
            return None;
        };
        let mut cut = Cut::new(tag.name, tag.end);
        match cut.advance(held.as_bytes()) {
            Step::Ended(end) => Some(held[end..].to_string()),
            Step::More => cut.first_stray().map(|at| held[at..].to_string()),
            Step::GiveUp => None,
        }
    }

    #[test]
    fn elements_whose_end_tag_is_left_out_end_where_html_ends_them() {
        for (held, left) in [
            ("<li id=a>ad<li>next</ul>", "<li>next</ul>"),
            ("<li id=a>ad</LI><li>next", "<li>next"),
            ("<li id=a>ad</ul><p>after", "</ul><p>after"),
            (
                "<li id=a><a href=x>ad</a> <span>x</span><li>next",
                "<li>next",
            ),
            ("<li id=a>ad<ul><li>x<li>y</ul>z<li>next", "<li>next"),
            ("<li id=a>ad</span>still<li>next", "<li>next"),
            ("<p id=a>ad<div>block</div>", "<div>block</div>"),
            ("<p id=a>ad<P>next", "<P>next"),
            ("<p id=a>ad</li><li>next", "</li><li>next"),
            ("<p id=a><b>ad</b></p>after", "after"),
            ("<dt id=a>term<dd>text", "<dd>text"),
            ("<dd id=a>text</dl>", "</dl>"),
            ("<option id=a>x<option>y", "<option>y"),
            ("<tr id=a><td>x<td><b>y<tr><td>z", "<tr><td>z"),
            ("<tr id=a><td>x</td></tr><tr>", "<tr>"),
            ("<td id=a>x<td>y", "<td>y"),
            ("<td id=a><span>x</tr><tr>", "</tr><tr>"),
            ("<td id=a><table><tr><td>in</table>x<td>y", "<td>y"),
            ("<tbody id=a><tr><td>x<tbody><tr>", "<tbody><tr>"),
            // Headings, marquees, objects and templates close what HTML lets go unclosed.
            ("<p id=a>promo</h2>After heading", "</h2>After heading"),
            ("<p id=a>news</MARQUEE>after", "</MARQUEE>after"),
            ("<li id=a>x</template><ul>", "</template><ul>"),
            ("<option id=a>Ad<hr><option>b", "<hr><option>b"),
            ("<option id=a>x<input name=q>", "<input name=q>"),
            ("<tr id=a><td>x<colgroup><col>", "<colgroup><col>"),
        ] {
            assert_eq!(left_after_cut(held).as_deref(), Some(left), "{held}");
        }
        // An implied end with elements still open that HTML may open again after it, or a
        // `<table>` in a `<p>` (inside it only in quirks mode): the rewriter is asked, which
        // leaves the element in place.
        for held in [
            "<li id=a><b>ad<li>next",
            "<li id=a><div>ad</ul>",
            "<p id=a><span>ad<div>",
            "<p id=a>ad<table><tr><td>x</table>",
            "<li id=a><script>x</script><li>",
        ] {
            assert_eq!(cut_all(held.as_bytes()), Step::GiveUp, "{held}");
        }
        // A container goes on past an end tag of a list that nothing inside it matches (HTML
        // ignores it unless the list is open around it, which is not known here) when its own
        // end tag comes; without that, it ends there.
        assert_eq!(
            left_after_cut("<div id=a><li>x</ul>y</div>z").as_deref(),
            Some("</ul>y</div>z")
        );
        assert_eq!(
            left_after_cut("<div id=a><li>x</ul>y<p>z").as_deref(),
            Some("</ul>y<p>z")
        );
    }

    #[test]
    fn a_scripts_end_is_found_through_its_escaped_states() {
        // Where each script ends: just past `</script` ending it (every byte before, from the
        // script's start tag on, is in the script).
        for script in [
            "<script>a = '<!-- x'; </script>",
            "<script><!-- var a = \"<script></script>\"; var b = '<div>'; //--></script>",
            "<script><!-- <script> --></script>",
            "<script><!-- <SCRIPT/> </script\t> --></script>",
            "<script><!-- a <scripts> b </script>",
            "<script><!--> <script></script>",
            "<script><!---> <script> </script>",
            "<script><!-- x --><script></script>",
            "<script><!-- <script> </scriptx> - -- --- </script> --></script>",
        ] {
            let page = format!("{script}<div>after</div>");
            let end = script.len() - 1;
            for chunk in [1, 2, 3, 5, 1 << 20] {
                let in_markup_after = |upto: usize| {
                    let mut state = TokenizerState::default();
                    for piece in page.as_bytes()[..upto].chunks(chunk) {
                        state.feed(piece);
                    }
                    state.in_markup_after(b"")
                };
                for upto in "<script>".len()..=end {
                    assert!(
                        !in_markup_after(upto),
                        "{script} up to {upto}, chunk {chunk}"
                    );
                }
                assert!(in_markup_after(page.len()), "{script}, chunk {chunk}");
            }
        }
    }

    #[test]
    fn an_element_missing_its_end_tag_ends_where_html_ends_it() {
        for (held, left) in [
            // The end tag of an element around it (with the tag, what follows passes on).
            (
                "<div id=a>R</td></tr></table><p>x",
                "</td></tr></table><p>x",
            ),
            ("<div id=a>R</li><li>next</li>", "</li><li>next</li>"),
            ("<div id=a>R</section><p>x", "</section><p>x"),
            ("<div id=a>R</MAIN><footer>F", "</MAIN><footer>F"),
            ("<span id=a>R</div><p>x", "</div><p>x"),
            ("<span id=a>R<b>x</i>y", "</i>y"),
            ("<div id=a><ul><li>x</ul>R</li><li>next", "</li><li>next"),
            // A start tag of its own kind.
            (
                "<a href=/1 id=a>R<a href=/2>two</a> tail",
                "<a href=/2>two</a> tail",
            ),
            ("<a id=a><b>R<a>y", "<a>y"),
            ("<button id=a>B<button>C</button>", "<button>C</button>"),
            ("<nobr id=a>x<NOBR>y", "<NOBR>y"),
            ("<h2 id=a>Title<h3>Sub</h3>", "<h3>Sub</h3>"),
            // What HTML closes inside, or ignores, leaves the element going on.
            ("<div id=a><h2>T</h3>more</div>after", "after"),
            ("<h2 id=a><b>x<h3>y</h3></b></H4>after", "after"),
            (
                "<div id=a><div><table><tr><td>x</div></td></tr></table></div></div>after",
                "after",
            ),
            ("<div id=a>x</span>y</div>after", "after"),
            ("<div id=a>x</p>y</br>z</div>after", "after"),
            ("<div id=a>x</form>y</div>after", "after"),
            ("<ul id=a><li>x</li></li>y</ul>after", "after"),
            (
                "<div id=a><table><tr><td>x</section>y</td></tr></table></div>after",
                "after",
            ),
            (
                "<button id=a><table><tr><td><button>x</button></td></tr></table></button>after",
                "after",
            ),
            // As before: ended at its own end tag even where HTML ignores it (less removed).
            ("<div id=a><table><tr><td>a</div><p>x", "<p>x"),
            // A stray end tag inside a module whose own end tag comes (a template's `</li>`,
            // `</td>`, `</section>` too many): the module is removed whole, as HTML ignores
            // the tag when nothing around it matches. (When something does, HTML had ended
            // the module there, and a later `</div>` of the page is taken for its end.)
            ("<div id=a><span>A</li>B</span></div><p>after", "<p>after"),
            ("<div id=a><p><b>A</td>B</b></div>after", "after"),
            // One whose own end tag follows with nothing open across the stray: ended at the
            // stray (less removed where HTML ignored it; where HTML ended the module there,
            // the `</div>` is a wrapper's of the page, which stays with what precedes it).
            (
                "<div id=a>A</section>B</div>after",
                "</section>B</div>after",
            ),
            (
                "<div id=a>R</td><td>keep</td></tr></table><p>x</p></div><p>after wrap",
                "</td><td>keep</td></tr></table><p>x</p></div><p>after wrap",
            ),
            (
                "<div id=a>R</li><li>next</li></ul></div>after",
                "</li><li>next</li></ul></div>after",
            ),
            (
                "<div id=a>R<p>para</section><p>x</p></div>after",
                "</section><p>x</p></div>after",
            ),
        ] {
            assert_eq!(left_after_cut(held).as_deref(), Some(left), "{held}");
        }
        // `</body>` and `</html>` close nothing open: the element runs on.
        assert_eq!(cut_all(b"<div id=a>R</body></html>"), Step::More);
    }
}
