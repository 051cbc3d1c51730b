"""Public ops: one function per op with a `backend` argument, plus its fake (meta) kernel."""
