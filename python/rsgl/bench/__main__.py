import sys

from rsgl.cli import run_bench

if __name__ == "__main__":
    raise SystemExit(run_bench(sys.argv[1:]))
