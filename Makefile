# pdmesh: `make up` installs and runs the main job; `make test` installs and runs the suite.
PY := .venv/bin/python
MODEL_DIR ?= .cache/models/tiny-qwen3

.PHONY: install up test test-compose image lint bench proto clean

install:
	@bash scripts/setup.sh

up: install
	@bash scripts/ensure_redis.sh
	$(PY) -m pdmesh up  # makes the tiny demo model in $(MODEL_DIR) on first use

test: install
	@bash scripts/ensure_redis.sh
	.venv/bin/ruff check pdmesh shared services tests
	$(PY) -m pytest -q tests --ignore=tests/compose

# the image (scripts/image.sh: offline, from a host-built wheelhouse; BASE=debian builds
# the base with debootstrap), then the whole mesh under `docker compose`
image: install
	@bash scripts/ensure_docker.sh
	BASE=$${BASE:-debian} bash scripts/image.sh

test-compose: image
	$(PY) -m pytest -q tests/compose

lint: install
	.venv/bin/ruff check pdmesh shared services tests

bench: install
	@[ -f $(MODEL_DIR)/config.json ] || $(PY) -m pdmesh make-tiny-model $(MODEL_DIR) --arch qwen3
	$(PY) -m pdmesh bench offline --model $(MODEL_DIR)

proto: install
	@bash scripts/gen_proto.sh $(PY)

clean:
	rm -rf .venv .cache
