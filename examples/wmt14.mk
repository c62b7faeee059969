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
#   MIRROR=URL         fetch the archives by their file names from a mirror instead (file:///dir
#                      or http://host/dir: a machine without the internet, a cluster's copy), with
#   CHECKSUMS=FILE     their SHA-256s (`sha256sum` output), if they are not the releases' own
#   DEV_SRC DEV_REF TEST_SRC TEST_REF   newstest2013/2014 from local files instead of sacrebleu's
#                      download
#
# Batches: 25000 source + 25000 target tokens per step over all GPUs (--batch-tokens 25000),
# shared evenly: 3125 per GPU on 8. MAX_TOKENS=N caps each GPU's forward pass (gradient
# accumulation makes up the rest; the same step on 8 GPUs, 4 or 1): unset by default, as a
# whole step's 25000 fit one 80 GB GPU, where 7 passes of 3572 would each launch the same
# kernels for a seventh of the work; set MAX_TOKENS=4096 on GPUs of 40 GB or less.
# Checkpoints by steps (base 1500, big 600): what the paper's every 10 minutes were at its
# 0.4 s and 1.0 s per step on P100s; a time would shrink the averaged window on faster GPUs.

ATTN ?= attn
PYTHON ?= python3
WORK ?= work
NPROC ?= 8
NNODES ?= 1
NODE_RANK ?= 0
MASTER ?= localhost:29500
MAX_TOKENS ?=
DTYPE ?= bf16
BEAM ?= 4
ALPHA ?= 0.6
VOCAB_SAMPLE ?= 4000000
ifdef DRYRUN
MAKEFLAGS += --dry-run
endif
TORCHRUN_COMMAND ?= torchrun
ifeq ($(NNODES),1)
TORCHRUN = $(TORCHRUN_COMMAND) --standalone --nproc-per-node $(NPROC)
else
TORCHRUN = $(TORCHRUN_COMMAND) --nnodes $(NNODES) --node-rank $(NODE_RANK) --nproc-per-node $(NPROC) \
	--rdzv-backend c10d --rdzv-endpoint $(MASTER)
endif
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

FETCH_URL = $(if $(MIRROR),$(MIRROR)/$(notdir $(URL_$*)),$(URL_$*))
# The archive's SHA-256 check: the release's own, or the mirror's line of CHECKSUMS
ifdef CHECKSUMS
CHECK_ARCHIVE = grep -E '[[:space:]]\*?$(notdir $(URL_$*))$$' $(abspath $(CHECKSUMS)) | \
	sed 's|[[:space:]]\+\*\?$(notdir $(URL_$*))$$|  $(ARCHIVE)|' | sha256sum -c --quiet -
CHECK_SIZE = true
else
CHECK_ARCHIVE = echo "$(SHA256_$*)  $(ARCHIVE)" | sha256sum -c --quiet -
CHECK_SIZE = test "$$(stat -c %s $(ARCHIVE))" = "$(SIZE_$*)" || { echo "$(ARCHIVE): $$(stat -c \
	%s $(ARCHIVE)) bytes, not $(SIZE_$*): run make again to resume the download" >&2; exit 1; }
endif

# One corpus: its archive fetched (resumed where a cut download stopped), checked, extracted
# (giga-fren's text is gzipped inside its tar), and the corpus's two files looked for.
$(DOWNLOAD)/%.extracted:
	mkdir -p $(DOWNLOAD)
	$(CHECK_ARCHIVE) 2>/dev/null || curl -fL --retry 3 -C - -o $(ARCHIVE) $(FETCH_URL)
	$(CHECK_SIZE)
	$(CHECK_ARCHIVE) || { rm -f $(ARCHIVE); \
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
ifdef DEV_SRC
	cp $(DEV_SRC) $(WORK)/valid.$(SRC) && cp $(DEV_REF) $(WORK)/valid.$(TGT)
else
	sacrebleu -t wmt13 -l $(PAIR) --echo src > $(WORK)/valid.$(SRC)
	sacrebleu -t wmt13 -l $(PAIR) --echo ref > $(WORK)/valid.$(TGT)
endif

$(WORK)/test.$(SRC) $(WORK)/test.$(TGT) &:
	mkdir -p $(WORK)
ifdef TEST_SRC
	cp $(TEST_SRC) $(WORK)/test.$(SRC) && cp $(TEST_REF) $(WORK)/test.$(TGT)
else
	sacrebleu -t wmt14/full -l $(PAIR) --echo src > $(WORK)/test.$(SRC)
	sacrebleu -t wmt14/full -l $(PAIR) --echo ref > $(WORK)/test.$(TGT)
endif

$(WORK)/spm.model: $(WORK)/train.$(SRC) $(WORK)/train.$(TGT)
	$(ATTN) vocab $^ -o $@ --size $(VOCAB_SIZE) --type bpe --sample $(VOCAB_SAMPLE)

$(WORK)/train.st: $(WORK)/spm.model $(WORK)/train.$(SRC) $(WORK)/train.$(TGT)
	$(ATTN) binarize --vocab $< $(WORK)/train.$(SRC) $(WORK)/train.$(TGT) -o $@

$(WORK)/valid.st: $(WORK)/spm.model $(WORK)/valid.$(SRC) $(WORK)/valid.$(TGT)
	$(ATTN) binarize --vocab $< $(WORK)/valid.$(SRC) $(WORK)/valid.$(TGT) -o $@

# ---- training: a checkpoint every SAVE_base / SAVE_big steps; re-running resumes
$(WORK)/%/done: $(WORK)/train.st $(WORK)/valid.st
	$(TORCHRUN) -m attn_cli train $(WORK)/train.st --valid $(WORK)/valid.st \
		-o $(WORK)/$* --preset $(PRESET_$*) --batch-tokens 25000 $(if $(MAX_TOKENS),--max-tokens $(MAX_TOKENS)) \
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
