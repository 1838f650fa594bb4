"""The one place sizes and counts are formatted for people. Inside the library sizes are int bytes."""

GIB = 1 << 30


def gib(n_bytes: int) -> float:
    return n_bytes / GIB


def format_gib(n_bytes: int, digits: int = 2) -> str:
    """Binary gibibytes, labelled: 13421772800 -> '12.50 GiB'."""
    return f"{n_bytes / GIB:.{digits}f} GiB"


def format_params(n: int) -> str:
    """SI parameter counts: 8030261248 -> '8.03 B', 124439808 -> '124.4 M'."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    if n >= 1e6:
        return f"{n / 1e6:.1f} M"
    if n >= 1e3:
        return f"{n / 1e3:.1f} K"
    return str(n)
