# Deployment with AWS SAM (included by the Makefile).
#
# The SAM CLI and cfn-lint live in their own venv, .tools: aws-sam-cli pins boto3/botocore
# (and more) to versions that must not replace the project's in .venv. Nothing here needs
# docker: every function and layer is built by its own Makefile (BuildMethod: makefile),
# and the dependency layer cross-installs arm64 wheels.
#
#   make validate                 cfn-lint + sam validate --lint
#   make build                    sam build into .aws-sam/build (ENV=default|prod)
#   make deploy ENV=prod          validate, build, sam deploy --config-env prod

PYTHON ?= python3
TOOLS ?= .tools
SAM ?= $(TOOLS)/bin/sam
CFN_LINT := $(TOOLS)/bin/cfn-lint
TOOLS_STAMP := $(TOOLS)/.installed
SAM_CLI_VERSION ?= 1.170.0
CFN_LINT_VERSION ?= 1.58.0
# A CPython 3.12 (Lambda's) lets the layer and function Makefiles ship bytecode; found once,
# else none.
ifeq ($(origin PY312),undefined)
PY312 := $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),\
  $(shell $(p) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && echo $(p))))
endif
export PY312
# samconfig.toml section: default (dev) or prod. Checked, since some shells export ENV.
ENV ?= default
CHECK_ENV = @case "$(ENV)" in default|prod) ;; \
  *) echo "ENV must be default or prod (a samconfig.toml section), got '$(ENV)'"; exit 2;; esac

export SAM_CLI_TELEMETRY := 0
export AWS_EC2_METADATA_DISABLED := true
# Only for commands that need some region to run offline; samconfig.toml names the real one.
export AWS_DEFAULT_REGION ?= us-east-1

$(TOOLS_STAMP): mk/sam.mk
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -qq --upgrade pip
	$(TOOLS)/bin/python -m pip install -qq \
	  aws-sam-cli==$(SAM_CLI_VERSION) cfn-lint==$(CFN_LINT_VERSION)
	@touch $@

.PHONY: tools
tools: $(TOOLS_STAMP) ## Create .tools with the SAM CLI and cfn-lint (kept out of .venv).

.PHONY: validate
validate: $(TOOLS_STAMP) ## Lint template.yaml: cfn-lint, then sam validate --lint.
	$(CHECK_ENV)
	$(CFN_LINT) template.yaml
	$(SAM) validate --lint --config-env $(ENV)

.PHONY: build
build: $(TOOLS_STAMP) ## sam build into .aws-sam/build, offline, no container (ENV=default|prod).
	$(CHECK_ENV)
	$(SAM) build --config-env $(ENV)

.PHONY: deploy
deploy: validate build ## Deploy the stack: make deploy ENV=prod (prod shows the change set first).
	$(CHECK_ENV)
	$(SAM) deploy --config-env $(ENV)
