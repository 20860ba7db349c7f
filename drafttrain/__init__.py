"""drafttrain: train speculative-decoding drafters and measure them with a lossless decoder.

The package holds config loading, target loading, data, drafter models, losses, the training
loop, export and the CLI. The decoder lives in `drafttrain.decode` (folder `decode/`) and the
evaluation harness in `drafttrain.eval` (folder `eval/`).
"""

__version__ = "0.1.0"
