"""``python -m attention_c.bench``: see attention_c.bench."""

import sys

from attention_c.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
