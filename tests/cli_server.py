"""One process that runs ``theseus`` commands one after another, for tests/test_readme.py.

``python cli_server.py FOLDER NAME [DEVICES]`` makes the named pipes ``FOLDER/NAME.in`` and
``FOLDER/NAME.out``. A client writes a command's arguments, each NUL-terminated, to
``FOLDER/NAME.args``, then a line to ``NAME.in``; the server runs the command in its folder
through the CLI's entry point (as ``python -m theseus`` does), its file descriptors 1 and 2 going
to ``NAME.stdout`` and ``NAME.stderr``, and writes its exit status as a line to ``NAME.out``.
Opening ``NAME.in`` and closing it unwritten ends the server. Arguments ``PYTHON_BLOCK CODE`` run
the Python source ``CODE`` instead, in a fresh ``__main__`` namespace as ``python -c CODE`` would
(for a README block that leaves JAX's configuration alone).

A fresh process per command pays for its interpreter, its imports (JAX, orbax, the CLI) and for
looking every program up in the compilation cache again; a server pays once. ``DEVICES``
simulates that many CPU devices, for commands that pass ``--cpu-devices DEVICES`` (JAX takes the
same count again, no other); without it the process sees one, as a plain ``theseus`` does.
"""

import os
import sys
import traceback
from pathlib import Path

PYTHON_BLOCK = "--python-block"


def run(arguments: list[str], stdout: Path, stderr: Path) -> int:
    """One command, its output in the two files; its exit status."""
    from theseus.cli.app import app

    saved = os.dup(1), os.dup(2)
    with stdout.open("wb") as out, stderr.open("wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            if arguments[:1] == [PYTHON_BLOCK]:
                exec(compile(arguments[1], "<string>", "exec"), {"__name__": "__main__"})
            else:
                app(arguments, prog_name="theseus")
            status = 0
        except SystemExit as done:
            code = done.code
            status = code if isinstance(code, int) else (0 if code is None else 1)
        except Exception:  # noqa: BLE001 (as an uncaught error ends python: a traceback, 1)
            traceback.print_exc()
            status = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    return status


def serve(folder: Path, name: str, devices: int | None) -> None:
    from theseus.cli.options import use_cpu_devices

    use_cpu_devices(devices)
    sys.path.insert(0, os.getcwd())  # as ``python -m`` does: --import finds the folder's modules
    requests, replies = folder / f"{name}.in", folder / f"{name}.out"
    os.mkfifo(requests)
    os.mkfifo(replies)
    print("ready", flush=True)
    while True:
        with requests.open() as wake:
            if not wake.readline():
                return  # the client's end closed without a request: done
        arguments = (folder / f"{name}.args").read_bytes().split(b"\0")[:-1]
        status = run(
            [a.decode() for a in arguments], folder / f"{name}.stdout", folder / f"{name}.stderr"
        )
        with replies.open("w") as reply:
            reply.write(f"{status}\n")


if __name__ == "__main__":
    serve(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
