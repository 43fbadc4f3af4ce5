"""``python -m idml`` (and ``torchrun -m idml``) runs the command-line interface."""

from idml.app.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
