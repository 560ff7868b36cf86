# checkov (included by the Makefile): policy checks of template.yaml.
#
# checkov pins boto3, botocore, pydantic and more to versions that must not replace the
# project's, so it lives in its own venv, .tools-checkov (not .venv, not the SAM CLI's .tools).
# Checks that do not apply are skipped in template.yaml itself, each with its reason
# (Metadata: checkov: skip: [{id, comment}]).
#
#   make checkov                  checkov on template.yaml (part of `make lint`)
#
# --skip-download: checkov would otherwise fetch check metadata from Prisma Cloud.

CHECKOV_VERSION ?= 3.3.30
CHECKOV_VENV := .tools-checkov
CHECKOV := $(CHECKOV_VENV)/bin/checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed
CHECKOV_ARGS := --file template.yaml --framework cloudformation --skip-download --compact --quiet

$(CHECKOV_STAMP): mk/checkov.mk
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -qq pip==$(PIP_VERSION)
	$(CHECKOV_VENV)/bin/python -m pip install -qq checkov==$(CHECKOV_VERSION)
	@touch $@

.PHONY: checkov-tools
checkov-tools: $(CHECKOV_STAMP) ## Create .tools-checkov with checkov (kept out of .venv).

.PHONY: checkov
checkov: $(CHECKOV_STAMP) ## checkov on template.yaml; fails on any failed check.
	$(CHECKOV) $(CHECKOV_ARGS)
