# Sourced by bench/run.sh and bench/callgrind.sh.

# filler_routes N: N routes the benchmark request never matches, in five match styles, for the
# route-table cases (the request matches the route after them).
filler_routes() {
	local i
	for ((i = 1; i <= $1; i++)); do
		printf '[[route]]\nname = "filler-%03d"\n' "$i"
		case $((i % 5)) in
		0) printf 'match = { path = "/legacy/page-%d.php" }\n' "$i" ;;
		1) printf 'match = { path_prefix = "/module-%d/" }\n' "$i" ;;
		2) printf 'match = { path_regex = "^/archive/%d/[0-9]+\\\\.php$" }\n' "$i" ;;
		3) printf 'match = { method = ["POST"], path_prefix = "/api/v%d/" }\n' "$i" ;;
		4) printf 'match = { host = "static-%d.example.test", path_prefix = "/" }\n' "$i" ;;
		esac
		printf 'upstream = "app"\n\n'
	done
}
