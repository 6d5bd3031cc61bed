"""Print the largest modules and functions of autopar's packages (lines of source), for
the architecture's size budget (DESIGN.md: no function over ~60 lines without a reason).

In: the package folders autopar/, strategies/, redistribution/, runtime/ under the repository
root (or those given as arguments). Out: two tables on stdout, the N largest modules (lines)
and the N largest functions and methods (lines from ``def`` to the last line of the body).
    python scripts/code_size.py [-n 10] [FOLDER ...]
"""
import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def functions(path: Path):
    """(qualified name, lines) for every function and method in one file."""
    tree = ast.parse(path.read_text(), str(path))
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out.append((name, child.end_lineno - child.lineno + 1))
                walk(child, name + ".")
    walk(tree, "")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=10)
    ap.add_argument("folders", nargs="*",
                    default=["autopar", "strategies", "redistribution", "runtime"])
    a = ap.parse_args(argv)
    files = sorted(p for f in a.folders for p in (ROOT / f).rglob("*.py"))
    mods = [(str(p.relative_to(ROOT)), len(p.read_text().splitlines())) for p in files]
    funcs = [(f"{p.relative_to(ROOT)}::{n}", k) for p in files for n, k in functions(p)]
    print(f"{len(mods)} modules, {sum(k for _, k in mods)} lines; {len(funcs)} functions, "
          f"{sum(k > 60 for _, k in funcs)} over 60 lines")
    for title, rows in (("modules", mods), ("functions", funcs)):
        print(f"\nlargest {a.n} {title}:")
        for name, k in sorted(rows, key=lambda r: -r[1])[:a.n]:
            print(f"  {k:6d}  {name}")


if __name__ == "__main__":
    main()
