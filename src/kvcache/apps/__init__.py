"""The applications built on the kvcache library: the ``kvcache`` command (generate, demo, bench,
eval), the synthetic tasks, tiny models, the byte tokenizer, the shipped trained model and the
benchmark suites. The library itself (``kvcache`` outside this package) never imports them."""
