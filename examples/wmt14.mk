# The paper's WMT 2014 experiments (§5-6), shared by wmt14-en-de/ and wmt14-en-fr/.
# Each includes this file after setting SRC TGT VOCAB_SIZE PRESET_big and CORPORA, the names of
# the training corpora, each with
#   URL_name     its archive: the WMT releases that fairseq's and tensor2tensor's scripts fetch
#   SIZE_name    the archive's size in bytes and SHA256_name its SHA-256 (as tensorflow-datasets
#                records them): a cut download resumes (wget -c), a corrupt one is deleted
#   FILES_name   the path of the corpus inside the archive, less its .$(SRC)/.$(TGT) suffix
#
#   make base          train the base model: 100K steps, average the last 5 checkpoints
#   make big           train the big model: 300K steps, average the last 20
#   make DRYRUN=1 ...  print every command instead of running it
#   NPROC=8            GPUs on this node (torchrun); NNODES, NODE_RANK, MASTER for several nodes:
#                      WORK must then be a directory every node sees (a shared file system), as
#                      every rank resumes from rank 0's checkpoints
#
# Batches: 25000 source + 25000 target tokens per step over all GPUs (--batch-tokens 25000);
# --max-tokens caps each GPU's forward pass, gradient accumulation makes up the rest, and the
# forward passes share the 25000 evenly, so the recipe is the same on 8 GPUs, 4 GPUs or 1.
# Checkpoints by steps (base 1500, big 600): what the paper's every 10 minutes were at its
# 0.4 s and 1.0 s per step on P100s; a time would shrink the averaged window on faster GPUs.

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
VOCAB_SAMPLE ?= 4000000
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

# ---- data: the WMT archives; newstest2013 (dev) and 2014 (test) via sacrebleu
DOWNLOAD = $(WORK)/download
ARCHIVE = $(DOWNLOAD)/$(notdir $(URL_$*))
TRAIN_SRC = $(foreach corpus,$(CORPORA),$(DOWNLOAD)/$(FILES_$(corpus)).$(SRC))
TRAIN_TGT = $(foreach corpus,$(CORPORA),$(DOWNLOAD)/$(FILES_$(corpus)).$(TGT))

# One corpus: its archive fetched (resumed where a cut download stopped), checked, extracted
# (giga-fren's text is gzipped inside its tar), and the corpus's two files looked for.
$(DOWNLOAD)/%.extracted:
	mkdir -p $(DOWNLOAD)
	cd $(DOWNLOAD) && wget -c --progress=dot:giga $(URL_$*)
	test "$$(stat -c %s $(ARCHIVE))" = "$(SIZE_$*)" || { echo "$(ARCHIVE): $$(stat -c %s \
		$(ARCHIVE)) bytes, not $(SIZE_$*): run make again to resume the download" >&2; exit 1; }
	echo "$(SHA256_$*)  $(ARCHIVE)" | sha256sum -c --quiet - || { rm -f $(ARCHIVE); \
		echo "$(ARCHIVE) is corrupt (SHA-256): deleted; run make again" >&2; exit 1; }
	tar -xf $(ARCHIVE) -C $(DOWNLOAD)
	find $(DOWNLOAD) -name '$(notdir $(FILES_$*)).*.gz' -exec gunzip -f {} +
	test -s $(DOWNLOAD)/$(FILES_$*).$(SRC) && test -s $(DOWNLOAD)/$(FILES_$*).$(TGT)
	touch $@

$(WORK)/train.$(SRC) $(WORK)/train.$(TGT) &: $(CORPORA:%=$(DOWNLOAD)/%.extracted)
	cat $(TRAIN_SRC) > $(WORK)/train.$(SRC)
	cat $(TRAIN_TGT) > $(WORK)/train.$(TGT)

$(WORK)/valid.$(SRC) $(WORK)/valid.$(TGT) &:
	mkdir -p $(WORK)
	sacrebleu -t wmt13 -l $(PAIR) --echo src > $(WORK)/valid.$(SRC)
	sacrebleu -t wmt13 -l $(PAIR) --echo ref > $(WORK)/valid.$(TGT)

$(WORK)/test.$(SRC) $(WORK)/test.$(TGT) &:
	mkdir -p $(WORK)
	sacrebleu -t wmt14/full -l $(PAIR) --echo src > $(WORK)/test.$(SRC)
	sacrebleu -t wmt14/full -l $(PAIR) --echo ref > $(WORK)/test.$(TGT)

$(WORK)/spm.model: $(WORK)/train.$(SRC) $(WORK)/train.$(TGT)
	$(ATTN) vocab $^ -o $@ --size $(VOCAB_SIZE) --type bpe --sample $(VOCAB_SAMPLE)

$(WORK)/train.st: $(WORK)/spm.model $(WORK)/train.$(SRC) $(WORK)/train.$(TGT)
	$(ATTN) binarize --vocab $< $(WORK)/train.$(SRC) $(WORK)/train.$(TGT) -o $@

$(WORK)/valid.st: $(WORK)/spm.model $(WORK)/valid.$(SRC) $(WORK)/valid.$(TGT)
	$(ATTN) binarize --vocab $< $(WORK)/valid.$(SRC) $(WORK)/valid.$(TGT) -o $@

# ---- training: a checkpoint every SAVE_base / SAVE_big steps; re-running resumes
$(WORK)/%/done: $(WORK)/train.st $(WORK)/valid.st
	$(TORCHRUN) -m attn_cli train $(WORK)/train.st --valid $(WORK)/valid.st \
		-o $(WORK)/$* --preset $(PRESET_$*) --batch-tokens 25000 --max-tokens $(MAX_TOKENS) \
		--max-steps $(STEPS_$*) --save-every $(SAVE_$*) --keep $(AVERAGE_$*) --dtype $(DTYPE) \
		--resume
	touch $@

$(WORK)/%.st: $(WORK)/%/done
	$(ATTN) average $(WORK)/$* --last $(AVERAGE_$*) -o $@

# ---- evaluation: beam 4, alpha 0.6, output length up to input + 50
$(WORK)/%.test.$(TGT): $(WORK)/%.st $(WORK)/test.$(SRC)
	$(ATTN) decode -m $< --beam $(BEAM) --alpha $(ALPHA) --max-len-a 1 --max-len-b 50 < $(WORK)/test.$(SRC) > $@.tmp && mv $@.tmp $@

# Three BLEU scores: sacreBLEU's (detokenized, 13a; with chrF), sacreBLEU's international
# tokenization, and the paper's own: tokenized, hyphenated compounds split (tensor2tensor's
# get_ende_bleu; the one to hold against Table 2)
$(WORK)/%.bleu: $(WORK)/%.test.$(TGT) $(WORK)/test.$(TGT)
	$(ATTN) score --ref $(WORK)/test.$(TGT) $< --metrics bleu,chrf > $@.tmp
	$(ATTN) score --ref $(WORK)/test.$(TGT) $< --metrics bleu --tokenize intl >> $@.tmp
	$(ATTN) score --ref $(WORK)/test.$(TGT) $< --metrics bleu --tokenize compound-split >> $@.tmp && mv $@.tmp $@
	cat $@

PRESET_base = base
STEPS_base = 100000
SAVE_base = 1500
AVERAGE_base = 5
STEPS_big = 300000
SAVE_big = 600
AVERAGE_big = 20

base: $(WORK)/base.bleu
big: $(WORK)/big.bleu

clean:
	rm -rf $(WORK)
