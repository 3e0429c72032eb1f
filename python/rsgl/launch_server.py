"""`python -m rsgl.launch_server ...`: the same as `rsgl serve ...` (for SGLang users)."""

from rsgl.server.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
