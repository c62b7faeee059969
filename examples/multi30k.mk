# What the Multi30k recipes share once their training data is made (multi30k/ and
# multi30k-student/ include it after making $(WORK)/spm.model and $(WORK)/train.st): the
# validation data, the training run (validation BLEU at each save, resumable), the average of
# its best checkpoints into $(WORK)/$(MODEL), and the test set decoded and scored. Each recipe
# sets ATTN WORK PRESET TRAIN_TIME SAVE_EVERY AVERAGE BEAM DTYPE TRAIN_OPTS TEST SRC TGT, and
#   MODEL       the averaged model's file name in $(WORK) (model.st)
#   ARCH_OPTS   the network's options over the preset's (`attn train --decoder-layers 1 ...`)

MODEL ?= model.st
ARCH_OPTS ?=

$(WORK)/valid.st: $(WORK)/spm.model $(WORK)/val.$(SRC) $(WORK)/val.$(TGT)
	$(ATTN) binarize --vocab $< $(WORK)/val.$(SRC) $(WORK)/val.$(TGT) -o $@

$(WORK)/run/done: $(WORK)/train.st $(WORK)/valid.st $(WORK)/val.$(TGT)
	$(ATTN) train $(WORK)/train.st --valid $(WORK)/valid.st -o $(WORK)/run --preset $(PRESET) \
		$(ARCH_OPTS) --max-time $(TRAIN_TIME) --save-every $(SAVE_EVERY) --log-every 100 \
		--dtype $(DTYPE) --valid-metric bleu --valid-ref $(WORK)/val.$(TGT) \
		--keep-best $(AVERAGE) --resume $(TRAIN_OPTS)
	touch $@

# The AVERAGE checkpoints with the best validation BLEU (the paper averages the last ones:
# `attn average $(WORK)/run --last $(AVERAGE)`).
$(WORK)/$(MODEL): $(WORK)/run/done
	$(ATTN) average $(WORK)/run --best $(AVERAGE) -o $@

$(WORK)/$(TEST).hyp.$(TGT): $(WORK)/$(MODEL) $(WORK)/$(TEST).$(SRC)
	$(ATTN) decode -m $< --beam $(BEAM) < $(WORK)/$(TEST).$(SRC) > $@.tmp && mv $@.tmp $@

$(WORK)/$(TEST).bleu: $(WORK)/$(TEST).hyp.$(TGT) $(WORK)/$(TEST).$(TGT)
	$(ATTN) score --ref $(WORK)/$(TEST).$(TGT) $< --metrics bleu,chrf > $@.tmp && mv $@.tmp $@
