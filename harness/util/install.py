"""The one wording of "how to install what is missing": mha-harness installs from a clone of its repository (it is
not on a package index), with the pins of ``constraints.txt``."""


def install_hint(extra: str) -> str:
    """The command that installs the extra ``extra`` (``torch``, ``jax``, ``onnx``, ``bench``, ``search``, ...)."""
    return f"pip install -c constraints.txt -e '.[{extra}]' from the mha-harness clone"
