"""The techniques that apply a model's plan, one module per technique; `apply.py` holds the one order they run in.

A regular package (not a namespace one), so that tools that read the source, such as the API reference of the
documentation (mkdocstrings), find its modules.
"""
