"""Training entry point for `accelerate launch drafttrain/train.py recipe=NAME key=value ...`.

A thin script over `drafttrain.cli`: the same as `drafttrain train ...`. Run as a script, it has
drafttrain/ first on sys.path, so it must import the package by its full name only.
"""

import sys

if __name__ == "__main__":
    from drafttrain.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
