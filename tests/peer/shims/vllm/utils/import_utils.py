def has_deep_gemm() -> bool:
    """dsa_indexer.compat.deep_gemm stands in for DeepGEMM."""
    return True


def has_cutedsl() -> bool:
    return False
