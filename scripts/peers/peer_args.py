"""Command-line handling shared by the peer scripts: `ARGS... [--cold] [--reps N]`."""
import sys


def parse(doc, default_reps=3):
    """Returns (positional args, cold, reps); prints `doc` and exits 2 without positionals."""
    argv = sys.argv[1:]
    reps = default_reps
    if "--reps" in argv:
        i = argv.index("--reps")
        reps = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    args = [a for a in argv if not a.startswith("--")]
    if not args:
        print(doc, file=sys.stderr)
        sys.exit(2)
    return args, "--cold" in argv, reps
