# onnx2fused developer workflow. Needs only python3 (with venv + pip) on a fresh clone.
#   make venv    create .venv (if missing) and (re)install when pyproject.toml changed
#   make test    run the test suite (pytest -q -n 2)
#   make demo    convert a zoo model and print the conversion report
#   make zoo     regenerate models/ (the zoo) with PyTorch
#   make wheel   build dist/onnx2fused-*.whl
#   make clean   remove build outputs (keeps .venv; `make distclean` removes it too)

PYTHON      ?= python3
VENV        ?= .venv
TORCH       ?= torch==2.13.0
EXTRAS      ?= cpu,test
PYTEST_ARGS ?=
XDIST       ?= -n 2 --dist loadgroup
DEMO        ?= nerf
DEMO_EXPORT ?= opset17

VPY   := $(VENV)/bin/python
STAMP := $(VENV)/.stamp
ZOO   := models/zoo.json

.PHONY: venv test demo zoo wheel clean distclean help

help:
	@sed -n 's/^#   //p' $(firstword $(MAKEFILE_LIST))

venv: $(STAMP)

# The stamp is newer than pyproject.toml once the install for that pyproject.toml succeeded.
# torch is installed first, pinned: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $@

# pytest exits 5 when it collects no tests: that is not a failure here.
test: venv
	@rc=0; $(VPY) -m pytest -q $(XDIST) $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: no tests collected"; rc=0; fi; exit $$rc

# Built only when missing (the zoo is committed); `make zoo` forces a rebuild.
$(ZOO): | $(STAMP)
	$(VPY) models/build_zoo.py

zoo: venv
	$(VPY) models/build_zoo.py

demo: venv $(ZOO)
	@mkdir -p build/demo
	$(VENV)/bin/onnx2fused convert models/$(DEMO).$(DEMO_EXPORT).onnx -o build/demo/$(DEMO).fused.onnx

wheel: venv
	$(VPY) -m build --wheel --outdir dist .

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
