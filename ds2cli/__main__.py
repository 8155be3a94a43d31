"""The `ds2` command's entry point (and `python -m ds2cli`).

ds2 imports NumPy, jinja2, tokenizers and rich before it can parse a single option, which takes
a noticeable fraction of a second: a Ctrl-C in that time must end ds2 as quietly as one during
a command (exit 130, no traceback). So the command line is imported here, inside the guard, and
the package's __init__ imports nothing heavy until a name of it is used."""

import sys


def main() -> None:
    try:
        from ds2cli.cli.main import main as cli
        cli()
    except KeyboardInterrupt:   # before the commands' own handler exists, or after it is done
        quiet_interrupt()


def quiet_interrupt() -> None:
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a second Ctrl-C must not start a traceback
    sys.stderr.write("\n")
    sys.exit(130)


if __name__ == "__main__":
    main()
