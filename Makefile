# The two commands the README promises; both set everything up first (idempotent).
.PHONY: demo test setup bench
demo:
	TP=$(TP) bash scripts/demo.sh $(DEMO_ARGS)
test:
	bash scripts/test.sh
setup:
	bash scripts/setup.sh
bench:
	bash scripts/setup.sh
	.venv/bin/python -m pytest bench -q -p no:cacheprovider --benchmark-json=build/bench.json $(BENCH_ARGS)
	.venv/bin/python bench/report.py build/bench.json
