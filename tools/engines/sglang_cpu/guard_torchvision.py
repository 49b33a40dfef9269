"""Guard torchvision's two `register_fake` decorators so it imports on the CPU torch.

    python guard_torchvision.py SITE_PACKAGES/torchvision/_meta_registrations.py

PyPI's torchvision is built against CUDA torch: its `_C.so` does not load on the CPU torch,
so its ops are never registered, and `@torch.library.register_fake("torchvision::nms")` (and
`qnms`) then fails the import ("operator torchvision::nms does not exist"). Every other meta
registration there is already guarded by `torchvision.extension._has_ops()`; these two get
the same guard. Exits non-zero, naming the file, when it does not hold exactly those two.
Run by tools/engines/sglang-venv.sh.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PLAIN = re.compile(r'^@torch\.library\.register_fake\("(torchvision::q?nms)"\)$', re.MULTILINE)
GUARDED = (
    r'@(torch.library.register_fake("\1") if torchvision.extension._has_ops() '
    r"else (lambda fn: fn))"
)


def main(path: Path) -> None:
    text = path.read_text()
    guarded, count = PLAIN.subn(GUARDED, text)
    if count != 2:
        sys.exit(f"guard_torchvision: expected 2 register_fake decorators of nms/qnms in {path}")
    path.write_text(guarded)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
