"""Demo towers and data for the scripts, benchmarks and tests; not part of the library.

They may import the library; the library never imports them (an import contract checks it).
"""
