"""Unpack the files under one folder of a wheel: unpack_wheel.py WHEEL PREFIX DEST [SUBPATH...].

Files under PREFIX (or only under PREFIX/SUBPATH for each SUBPATH given) are
written below DEST with PREFIX stripped. Used to take headers and sources out
of a wheel without installing the package.
"""
import os
import sys
import zipfile


def main(wheel: str, prefix: str, dest: str, *subpaths: str) -> None:
    prefix = prefix.rstrip("/") + "/"
    keep = tuple(prefix + s for s in subpaths) or (prefix,)
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith(keep) and not name.endswith("/"):
                target = os.path.join(dest, name[len(prefix):])
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with z.open(name) as src, open(target, "wb") as dst:
                    dst.write(src.read())


if __name__ == "__main__":
    main(*sys.argv[1:])
