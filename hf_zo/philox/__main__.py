"""``python -m hf_zo.philox --build``: compile the noise kernel now (``make install`` runs it)."""

import argparse
import sys

from .extension import KERNEL_NAME, build, load_kernel


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_zo.philox", description=__doc__)
    parser.add_argument("--build", action="store_true", help="compile (or load from the cache) the CPU kernel")
    args = parser.parse_args()
    if not args.build:
        parser.print_help()
        return 2
    try:
        seconds = build(verbose=True)
        simd = load_kernel().simd()  # also checks HF_ZO_PHILOX_SIMD
    except Exception as error:
        print(f"Building {KERNEL_NAME} failed: {error}\nhf_zo will use its slower torch noise.", file=sys.stderr)
        return 1
    print(f"{KERNEL_NAME} ready ({seconds:.1f} s; {simd} code on this CPU).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
