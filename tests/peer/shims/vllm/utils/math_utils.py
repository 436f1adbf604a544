def cdiv(a: int, b: int) -> int:
    return -(-a // b)
