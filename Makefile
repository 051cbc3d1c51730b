# The two commands the README promises; both set everything up first (idempotent).
.PHONY: demo test setup bench
demo:
	bash scripts/demo.sh
test:
	bash scripts/test.sh
setup:
	bash scripts/setup.sh
bench:
	bash scripts/setup.sh && .venv/bin/python -m pytest bench -q --benchmark-only
