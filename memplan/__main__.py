"""``python -m memplan``: the same as the ``memplan`` console script."""

from memplan.cli.app import main

if __name__ == "__main__":
    main()
