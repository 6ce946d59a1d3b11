"""A script that starts worker processes must keep its top-level call under ``if __name__ == "__main__":``:
multiprocessing runs the main module again in every worker (to find the classes it defines), and a call at its top
level would start the whole run again there. This module tells the user so, before a worker starts and inside one
that is importing the script, instead of a worker that crashes or hangs until its start times out."""
from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

#: the advice every refusal starts with
GUARD_ADVICE = ("put the call under `if __name__ == \"__main__\":` (multiprocessing imports your script again in "
                "each worker process, to find the classes it defines, and a call at its top level would run again "
                "there)")
#: the way around the workers that check() and search() have
IN_PROCESS = "pass isolate=False to run the plugin code in this process"


def refuse_unguarded_main(entry: str, alternative: str | None = IN_PROCESS) -> None:
    """A RuntimeError naming ``entry`` (e.g. ``mha_harness.check(isolate=True)``) when it would start workers from a
    script that runs it unguarded: inside a worker that is importing the main script (multiprocessing's
    bootstrapping), or, in the parent, when the main script (a file: not an interactive session or a notebook) has
    no ``if __name__ == "__main__":`` guard at all, so every worker would run the script's calls again.
    ``alternative``: the way to run without workers, where the entry has one (the advice ends with it)."""
    advice = f"{GUARD_ADVICE}, or {alternative}" if alternative else GUARD_ADVICE
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(f"{entry} was called while a worker process imports your script: {advice}")
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not Path(path).is_file():  # an interactive session or a notebook: nothing is imported again
        return
    spec = getattr(main, "__spec__", None)
    if spec is not None and (spec.name or "").endswith(".__main__"):
        return  # `python -m package`: multiprocessing does not import a package's __main__ again in its workers
    try:
        source = Path(path).read_text(errors="replace")
    except OSError:
        return
    if "__name__" in source and "__main__" in source:
        return  # a guard of some form: its calls run only in the main process
    raise RuntimeError(f"{entry} was called from {path}, which has no `if __name__ == \"__main__\":` guard: "
                       f"{advice}")
