"""`k3verify` command line. Each subcommand lives in its own module and exposes
`cli(argv) -> int`; bad input or usage exits 2 with one line on stderr."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("harness.demo", "synthesize tiny captures, replay them through the best backend here, write reports"),
    "replay": ("harness.replay", "replay captures through a backend and judge every stage"),
    "synth": ("harness.synth", "write synthetic captures (reference run over a stack of layers)"),
    "golden": ("harness.golden", "regenerate or check the golden files"),
    "compile": ("harness.compile_cmd", "compile FlyDSL builds without running them; print ISA resources"),
    "policy": ("harness.derive", "derive the policy's chained limits from the reference's own spread"),
    "diff": ("harness.diff", "compare two JSON reports: did the numerics get worse?"),
    "ref": ("harness.ref_cmd", "run the reference over one synthetic step and print a per-stage summary"),
    "drift": ("harness.drift", "run backend, reference and oracle closed-loop over many decode steps; judge drift"),
    "group": ("harness.group", "assemble a per-rank recording (the vLLM plugin's) into capture sets"),
}


def usage() -> str:
    from .errors import EXIT_HELP

    lines = ["usage: k3verify COMMAND [options]   (k3verify COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {c:<8} {h}" for c, (_, h) in COMMANDS.items()]
    lines += ["", EXIT_HELP]
    return "\n".join(lines)


def _few_arenas() -> None:
    """glibc gives every thread that allocates its own malloc arena and keeps what it freed:
    the simulated ranks' threads then grow the process set after set. Two arenas, and blocks
    of 1 MiB and more always mapped (glibc otherwise raises that threshold to the largest
    block freed, and the judge's stacked temporaries then stay in the heap), keep the peak
    flat. `MALLOC_ARENA_MAX` / `MALLOC_MMAP_THRESHOLD_` in the environment still win."""
    import ctypes
    import os
    import platform

    if platform.system() != "Linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        if "MALLOC_ARENA_MAX" not in os.environ:
            libc.mallopt(-8, 2)  # M_ARENA_MAX
        if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def main(argv=None) -> int:
    from ref.abi import ArgError

    _few_arenas()
    from .errors import EXIT_INCOMPLETE, EXIT_USAGE, Incomplete, InputError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"k3verify: unknown command {cmd!r}\n{usage()}", file=sys.stderr)
        return 2
    mod = importlib.import_module(COMMANDS[cmd][0])
    try:
        return int(mod.cli(rest) or 0)
    except (InputError, ArgError) as e:
        print(f"k3verify {cmd}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Incomplete as e:
        print(f"k3verify {cmd}: could not finish: {e}", file=sys.stderr)
        return EXIT_INCOMPLETE
    except KeyboardInterrupt:
        print(f"k3verify {cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
