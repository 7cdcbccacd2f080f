"""``python -m selfspec ...``: the same command line as ``selfspec ...`` (selfspec.cli)."""

from selfspec.cli import run

if __name__ == "__main__":
    run()
