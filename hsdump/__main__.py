"""``python -m hsdump``: the ``hsdump`` command, where the console script is not on ``PATH``."""

from hsdump._cli import main

if __name__ == "__main__":
    main()
