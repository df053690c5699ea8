# Conveniences for developers; the README's two commands call the scripts directly so that they
# work on a machine without make.
.PHONY: demo test format tidy fuzz-corpus
demo:
	./scripts/demo.sh
test:
	./scripts/test.sh
format:
	clang-format -i $$(git ls-files '*.cc' '*.h')
tidy:
	clang-tidy -p build/asan $$(git ls-files '*.cc' | grep -v fuzz/)
