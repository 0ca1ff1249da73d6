"""Backends of attention_c for other libraries.

- :mod:`attention_c.integrations.transformers`: an ``attn_implementation``
  for Hugging Face transformers (``register()``, then
  ``attn_implementation="attention_c"``).

Each submodule imports its library on import; this package imports none.
"""
