"""Native CPU kernels: C sources shipped with the package, compiled on first use.

Each kernel is built once per machine (the source, compiler and CPU features
form the cache key) into the kernel cache directory and loaded with ctypes.
Callers always keep a pure-torch path for machines without a C compiler.
"""
