"""Training entry point for `accelerate launch drafttrain/train.py recipe=NAME key=value ...`.

A thin script over `drafttrain.cli`: the same as `drafttrain train ...`. Run as a script, Python
puts drafttrain/ first on sys.path, where a module named like a standard-library one (say
`profile`) would shadow it for torch and transformers; so the script drops its own folder from
sys.path and imports the package by its full name only.
"""

import os
import sys

if __name__ == "__main__":
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    from drafttrain.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
