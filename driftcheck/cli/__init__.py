"""The command line: ``driftcheck record | compare | run | probe | report | models``.

Exit codes everywhere: 0 pass, 1 gate failed, 2 bad input (one line on stderr, no traceback
unless --debug). torch is imported only inside commands, after the device is known, so a
CPU/CUDA reference never autoloads torch_tpu.
"""
from __future__ import annotations

import atexit
import gc
import sys

import click

from driftcheck.cli import commands  # noqa: F401  (registers the commands on the group)
from driftcheck.cli.app import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_PASS, cli, one_line
from driftcheck.cli.commands import probe_main
from driftcheck.errors import DriftcheckError

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAIL", "EXIT_PASS", "cli", "main", "probe_main"]


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: maps errors to exit codes.

    No full (generation-2) garbage collections while a command runs; the young generations are
    still collected as usual. Importing torch, numba and transformers leaves ~300k long-lived
    objects and every full collection walks them all: ~1 s of a 60-step record or of a compare
    of it (25% and 16%, same peak memory; docs/performance.md).

    At the interpreter's exit, none either: it would walk them several times over (~0.5 s of a
    process that imported torch, ~0.6 s with torch's compiler front end: three such processes
    end one after the other in ``driftcheck run``), and the OS reclaims the memory anyway."""
    _skip_collections_at_exit()
    threshold = gc.get_threshold()
    gc.set_threshold(threshold[0], threshold[1], 1 << 30)
    try:
        _main(argv)
    finally:
        gc.set_threshold(*threshold)  # main() called in-process (tests) leaves it as it was


_exit_hook: list[bool] = []


def _skip_collections_at_exit() -> None:
    """Freeze every object still alive when the interpreter exits (``gc.freeze``): its final
    collections then skip them. Registered once, at a command's first call; ``atexit`` runs it
    only when the process ends, so a test process that calls ``main`` is untouched until then."""
    if not _exit_hook:
        _exit_hook.append(True)
        atexit.register(gc.freeze)


def _main(argv: list[str] | None) -> None:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        cli.main(args=argv, prog_name="driftcheck", standalone_mode=False)
    except SystemExit as e:
        raise SystemExit(e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_BAD_INPUT))
    except click.exceptions.Abort:
        click.echo("driftcheck: interrupted", err=True)
        raise SystemExit(130)
    except click.ClickException as e:
        e.show()
        raise SystemExit(EXIT_BAD_INPUT)
    except DriftcheckError as e:
        if debug:
            import traceback

            traceback.print_exc()
        click.echo(f"driftcheck: {one_line(str(e))}", err=True)
        raise SystemExit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        click.echo("driftcheck: interrupted", err=True)
        raise SystemExit(130)
    except MemoryError:
        click.echo("driftcheck: out of memory", err=True)
        raise SystemExit(EXIT_BAD_INPUT)
    except OSError as e:  # the disk is full, read-only or gone: the user's environment, not a bug
        if debug:
            raise
        where = f" on {e.filename}" if e.filename else ""
        click.echo(f"driftcheck: I/O error{where}: {e.strerror or e}; check free space, permissions "
                   "and the path", err=True)
        raise SystemExit(EXIT_BAD_INPUT)
    except Exception as e:  # an unexpected failure: still one line, the traceback with --debug
        if debug:
            raise
        click.echo(f"driftcheck: unexpected {type(e).__name__}: {e} (rerun with --debug for the "
                   "traceback and report it)", err=True)
        raise SystemExit(EXIT_BAD_INPUT)
    raise SystemExit(EXIT_PASS)
