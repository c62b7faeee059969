# The paper's WMT 2014 experiments (§5-6), shared by wmt14-en-de/ and wmt14-en-fr/.
# Each includes this file after setting: SRC TGT VOCAB_SIZE PRESET_big CORPORA (URLs to fetch) and
# the glob TRAIN_GLOB_SRC/TRAIN_GLOB_TGT of the extracted training text.
#
#   make base          train the base model: 100K steps, average the last 5 checkpoints
#   make big           train the big model: 300K steps, average the last 20
#   make DRYRUN=1 ...  print every command instead of running it
#   NPROC=8            GPUs on this node (torchrun); NNODES, NODE_RANK, MASTER for several nodes
#
# Batches: 25000 source + 25000 target tokens per step over all GPUs (--batch-tokens 25000);
# --max-tokens caps each GPU's forward pass, gradient accumulation makes up the rest, so the recipe
# is the same on 8 GPUs, 4 GPUs or 1.

ATTN ?= attn
PYTHON ?= python3
WORK ?= work
NPROC ?= 8
NNODES ?= 1
NODE_RANK ?= 0
MASTER ?= localhost:29500
MAX_TOKENS ?= 4096
DTYPE ?= bf16
BEAM ?= 4
ALPHA ?= 0.6
ifdef DRYRUN
MAKEFLAGS += --dry-run
endif
TORCHRUN = torchrun --nnodes $(NNODES) --node-rank $(NODE_RANK) --nproc-per-node $(NPROC) \
	--rdzv-backend c10d --rdzv-endpoint $(MASTER)
PAIR = $(SRC)-$(TGT)

.PHONY: all base big data clean
.SECONDARY:

all: base big

data: $(WORK)/train.st $(WORK)/valid.st

# ---- data: the standard download locations; newstest2013 (dev) and 2014 (test) via sacrebleu
$(WORK)/download/done:
	mkdir -p $(WORK)/download
	cd $(WORK)/download && for url in $(CORPORA); do \
		wget -nc -q $$url && tar -xf $$(basename $$url) || exit 1; done && \
		find . -name '*.gz' -exec gunzip -f {} +
	touch $@

$(WORK)/train.$(SRC) $(WORK)/train.$(TGT) &: $(WORK)/download/done
	cat $(TRAIN_GLOB_SRC) > $(WORK)/train.$(SRC)
	cat $(TRAIN_GLOB_TGT) > $(WORK)/train.$(TGT)

$(WORK)/valid.$(SRC) $(WORK)/valid.$(TGT) &:
	mkdir -p $(WORK)
	sacrebleu -t wmt13 -l $(PAIR) --echo src > $(WORK)/valid.$(SRC)
	sacrebleu -t wmt13 -l $(PAIR) --echo ref > $(WORK)/valid.$(TGT)

$(WORK)/test.$(SRC) $(WORK)/test.$(TGT) &:
	mkdir -p $(WORK)
	sacrebleu -t wmt14/full -l $(PAIR) --echo src > $(WORK)/test.$(SRC)
	sacrebleu -t wmt14/full -l $(PAIR) --echo ref > $(WORK)/test.$(TGT)

$(WORK)/spm.model: $(WORK)/train.$(SRC) $(WORK)/train.$(TGT)
	$(ATTN) vocab $^ -o $@ --size $(VOCAB_SIZE) --type bpe --sample 10000000

$(WORK)/train.st: $(WORK)/spm.model $(WORK)/train.$(SRC) $(WORK)/train.$(TGT)
	$(ATTN) binarize --vocab $< $(WORK)/train.$(SRC) $(WORK)/train.$(TGT) -o $@

$(WORK)/valid.st: $(WORK)/spm.model $(WORK)/valid.$(SRC) $(WORK)/valid.$(TGT)
	$(ATTN) binarize --vocab $< $(WORK)/valid.$(SRC) $(WORK)/valid.$(TGT) -o $@

# ---- training: checkpoints every 10 minutes; re-running resumes
$(WORK)/%/done: $(WORK)/train.st $(WORK)/valid.st
	$(TORCHRUN) -m attn_cli train $(WORK)/train.st --valid $(WORK)/valid.st \
		-o $(WORK)/$* --preset $(PRESET_$*) --batch-tokens 25000 --max-tokens $(MAX_TOKENS) \
		--max-steps $(STEPS_$*) --save-every 10m --keep $(AVERAGE_$*) --dtype $(DTYPE) --resume
	touch $@

$(WORK)/%.st: $(WORK)/%/done
	$(ATTN) average $(WORK)/$* --last $(AVERAGE_$*) -o $@

# ---- evaluation: beam 4, alpha 0.6, output length up to input + 50
$(WORK)/%.test.$(TGT): $(WORK)/%.st $(WORK)/test.$(SRC)
	$(ATTN) decode -m $< --beam $(BEAM) --alpha $(ALPHA) --max-len-a 1 --max-len-b 50 < $(WORK)/test.$(SRC) > $@.tmp && mv $@.tmp $@

# sacreBLEU (detokenized, 13a) and the paper-style tokenized BLEU (international tokenization)
$(WORK)/%.bleu: $(WORK)/%.test.$(TGT) $(WORK)/test.$(TGT)
	$(ATTN) score --ref $(WORK)/test.$(TGT) $< --metrics bleu,chrf > $@.tmp
	$(ATTN) score --ref $(WORK)/test.$(TGT) $< --metrics bleu --tokenize intl >> $@.tmp && mv $@.tmp $@
	cat $@

PRESET_base = base
STEPS_base = 100000
AVERAGE_base = 5
STEPS_big = 300000
AVERAGE_big = 20

base: $(WORK)/base.bleu
big: $(WORK)/big.bleu

clean:
	rm -rf $(WORK)
