"""Op families: each folder holds ``reference.py`` (PyTorch, any device) and its dispatch in
``__init__.py``; Triton kernels live beside the reference in ``triton.py``."""
