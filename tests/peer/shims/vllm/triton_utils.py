"""The real Triton, as vLLM re-exports it (test modules define kernels at import)."""

import triton  # noqa: F401
import triton.language as tl  # noqa: F401
