"""Shared by the benchmark scripts in this folder: fixed-width tables on stdout."""


def print_table(title: str, columns: list[tuple[str, int]], rows: list[list[str]]) -> None:
    print()
    print(title)
    header = " ".join(f"{name:>{width}}" for name, width in columns)
    print(header)
    print("-" * len(header))
    for row in rows:
        print(" ".join(f"{cell:>{width}}" for cell, (_, width) in zip(row, columns)))
