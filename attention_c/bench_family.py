"""``python -m attention_c.bench_family``: the former name of ``python -m
attention_c.bench.family``, the attention family's benchmark."""

import sys

from attention_c.bench.family import main

if __name__ == "__main__":
    sys.exit(main())
