// attn's decoder step and free beam search in C++ (issue 53, stage A), for a model made for
// decoding on a CPU (devices.inference_model: oneDNN's packed linear layers, torch's dense ones,
// or --int8's): `model.Transformer.decode_step` as one call that holds no Python and releases
// the GIL, and `search.beam_search` of a batch with no constraint as one call.
//
// Every op below is the ATen op the Python code dispatches, with the same arguments, in the same
// order, so the logits are the eager step's and the hypotheses the Python search's, bit for bit
// (tests/decode/test_native.py holds them equal). The step: embedding, scale and position; per
// layer the QKV projection, the cache grown in one copy into a spare buffer (model.grow_cache),
// the one-query attention written out as two batched matmuls with the softmax in float32
// (model.attention_written_out), the encoder-decoder attention of the G beams of a source
// together (attend_memory), residual and LayerNorm after each sub-layer (or before it,
// pre-norm), the feed-forward block, and the output projection. What the Python code pays and
// this does not: ~170 Python calls a decoder step (3 layers) and ~100 a search step, each
// parsing its arguments and taking the GIL back.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace {

using at::Tensor;

// x W^T + b through oneDNN's blocked weight, the activation ("none", "relu", "swish") fused:
// devices.PackedLinear's call.
Tensor packed_linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                     const std::string& activation) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                        c10::string_view, c10::List<std::optional<c10::Scalar>>,
                        std::optional<c10::string_view>)>();
  return op.call(x, weight, bias, activation, c10::List<std::optional<c10::Scalar>>(),
                 c10::string_view(""));
}

// torch's dynamic int8 linear (devices.int8_linears: torch.ao's quantized dynamic Linear):
// the input quantized by its own range, int8 weights packed with their bias in `params`.
Tensor int8_linear(const Tensor& x, const c10::IValue& params, bool reduce_range) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("quantized::linear_dynamic", "");
  torch::jit::Stack stack{x, params, reduce_range};
  op.callBoxed(&stack);
  return stack[0].toTensor().to(x.scalar_type());
}

// A linear layer as the model holds it: packed (devices.PackedLinear, its activation fused),
// dense (nn.Linear) or int8 (--int8), the activation of the last two, if any, applied after it
// as FeedForward does.
struct Linear {
  enum Kind { kDense, kPacked, kInt8 } kind = kDense;
  Tensor weight;
  std::optional<Tensor> bias;
  std::string activation = "none";
  c10::IValue params;  // int8: the packed weight and bias
  bool reduce_range = true;

  Tensor operator()(const Tensor& x) const {
    if (kind == kPacked) return packed_linear(x, weight, bias, activation);
    Tensor y = kind == kInt8 ? int8_linear(x, params, reduce_range) : at::linear(x, weight, bias);
    if (activation == "relu") return at::relu(y);
    if (activation == "swish") return at::silu(y);
    return y;
  }
};

struct Norm {
  Tensor weight, bias;
  double eps = 1e-5;

  Tensor operator()(const Tensor& x) const {
    return at::layer_norm(x, {x.size(-1)}, weight, bias, eps, /*cudnn_enable=*/true);
  }
};

struct Layer {
  Linear qkv, self_out, cross_q, cross_out, inner, outer;
  Norm norms[3];
};

// model.attention_written_out: softmax(Q K^T / sqrt(d_k)) V, the softmax in float32.
Tensor attention_written_out(const Tensor& queries, const Tensor& keys_t, const Tensor& values,
                             const Tensor* mask) {
  Tensor weights = at::matmul(queries, keys_t).to(at::kFloat);
  weights.mul_(std::pow(static_cast<double>(queries.size(-1)), -0.5));
  if (mask != nullptr) weights.add_(*mask);
  return at::matmul(at::softmax(weights, -1).to(values.scalar_type()), values);
}

// model.grow_cache: past (its `rows`, if given) then fresh, in one copy into `spare` when it is
// large enough, else into a new buffer a quarter larger than needed. Returns the grown cache
// and its buffer.
std::pair<Tensor, Tensor> grow_cache(const Tensor& past, const Tensor& fresh,
                                     const std::optional<Tensor>& rows,
                                     const std::optional<Tensor>& spare) {
  const int64_t length = past.size(2);
  const std::vector<int64_t> shape{fresh.size(0), past.size(1), length + 1, past.size(3)};
  const int64_t size = shape[0] * shape[1] * shape[2] * shape[3];
  Tensor buffer = spare.has_value() && spare->numel() >= size
                      ? *spare
                      : fresh.new_empty({size + size / 4});
  Tensor grown = buffer.slice(0, 0, size).view(shape);
  Tensor head = grown.slice(2, 0, length);
  if (rows.has_value()) {
    at::index_select_out(head, past, 0, *rows);
  } else {
    head.copy_(past);
  }
  grown.slice(2, length).copy_(fresh);
  return {grown, buffer};
}

// model.DecoderCache: the source side per sentence (src_mask, memory_kv: per layer the keys
// transposed and the values), the self-attention keys and values per hypothesis (self_kv, per
// layer two), the rows of them the next step continues (self_rows; none: all), the buffers
// they are views of and the spare pair the next step writes into, and the step.
struct Cache {
  Tensor src_mask;
  std::vector<Tensor> memory_kv, self_kv;
  std::optional<Tensor> self_rows;
  std::vector<Tensor> buffers, spare;
  int64_t step = 0;

  // model.reordered: continue hypothesis rows `rows` of the sentences `sources` (none: the
  // same); the self-attention rows are gathered by the next step, the source side now.
  void reorder(const Tensor& rows, const std::optional<Tensor>& sources) {
    self_rows = self_rows.has_value() ? self_rows->index_select(0, rows) : rows;
    if (!sources.has_value()) return;
    for (Tensor& tensor : memory_kv) tensor = tensor.index_select(0, *sources);
    src_mask = src_mask.index_select(0, *sources);
  }
};

// What search.start_search set up for a free search of one batch.
struct SearchBatch {
  Tensor src_mask;
  std::vector<Tensor> memory_kv, self_kv;  // the encoder's pass; empty self-attention caches
  std::optional<Linear> output;            // a shortlist's projection (none: the model's)
  std::optional<Tensor> column_ids;        // a shortlist's ids: column c is ids[c]
  Tensor limits;                           // (B,) each sentence's longest output, EOS included
  std::vector<int64_t> limit_lengths;      // the lengths at which some sentence reaches it
  Tensor banned;                           // the columns never chosen
  Tensor penalties;                        // (L + 1,) float64 length penalties
  int64_t eos_column, eos_id, bos_id, beam, nbest, stop;
  double alpha;
};

class Decoder {
 public:
  Decoder(int64_t heads, int64_t d_k, int64_t d_v, bool pre_norm, Tensor embedding,
          double embed_scale, int64_t pad_id, std::vector<Linear> linears, std::vector<Norm> norms,
          std::optional<Norm> final_norm, Linear output)
      : heads_(heads), d_k_(d_k), d_v_(d_v), pre_norm_(pre_norm),
        embedding_(std::move(embedding)), embed_scale_(embed_scale), pad_id_(pad_id),
        final_norm_(std::move(final_norm)), output_(std::move(output)) {
    TORCH_CHECK(linears.size() % 6 == 0 && norms.size() == linears.size() / 2,
                "a decoder layer has 6 linear layers and 3 norms");
    for (size_t i = 0; i < linears.size() / 6; ++i) {
      Layer layer{linears[6 * i], linears[6 * i + 1], linears[6 * i + 2],
                  linears[6 * i + 3], linears[6 * i + 4], linears[6 * i + 5],
                  {norms[3 * i], norms[3 * i + 1], norms[3 * i + 2]}};
      layers_.push_back(std::move(layer));
    }
  }

  // One step of N hypotheses: tokens (N,) at the position whose row is `position` (1, D).
  // memory_kv: per layer the encoder-decoder keys (transposed) and values; self_kv: per layer
  // the self-attention keys and values so far, `self_rows` of them continued (none: all);
  // spare: per layer the two buffers to grow them into (none: new ones). Returns the logits
  // (N, V) (with `project` false, the decoder's output (N, D) for a shortlist's projection),
  // the grown keys and values, and their buffers, as `Transformer.decode_step` does.
  std::tuple<Tensor, std::vector<Tensor>, std::vector<Tensor>> step(
      const Tensor& tokens, const Tensor& position, const Tensor& src_mask,
      const std::vector<Tensor>& memory_kv, const std::vector<Tensor>& self_kv,
      const std::optional<Tensor>& self_rows, const std::vector<Tensor>& spare,
      bool project) const {
    TORCH_CHECK(memory_kv.size() == 2 * layers_.size() && self_kv.size() == memory_kv.size() &&
                    (spare.empty() || spare.size() == memory_kv.size()),
                "a step takes two cache tensors per decoder layer");
    Cache cache{src_mask, memory_kv, self_kv, self_rows, {}, spare, 0};
    Tensor hidden = hidden_step(tokens, position, cache);
    return {project ? output_(hidden) : hidden, std::move(cache.self_kv),
            std::move(cache.buffers)};
  }

  // search.beam_search of one batch, for a free search (no constraint; over the whole
  // vocabulary or a shortlist's columns, `output` and `column_ids`), every step here: the
  // same ATen ops as the Python search, in the same order, so the same hypotheses with the
  // same scores. Returns search.finished_rows's rows, one tensor per step where some finished.
  std::vector<Tensor> beam_search(const SearchBatch& batch, const Tensor& positions,
                                  const std::optional<pybind11::function>& cancelled) const;

 private:

  // The decoder's output (N, D) of one step; `cache` grown to match (the lazy reorder applied).
  Tensor hidden_step(const Tensor& tokens, const Tensor& position, Cache& cache) const {
    const size_t count = layers_.size();
    Tensor x = at::embedding(embedding_, tokens.unsqueeze(1), pad_id_) * embed_scale_ + position;
    std::vector<Tensor> grown, buffers;
    grown.reserve(2 * count);
    buffers.reserve(2 * count);
    const int64_t rows = x.size(0), q_width = heads_ * d_k_, v_width = heads_ * d_v_;
    for (size_t i = 0; i < count; ++i) {
      const Layer& layer = layers_[i];
      // self-attention over every position so far and this one
      Tensor h = pre_norm_ ? layer.norms[0](x) : x;
      auto parts = layer.qkv(h).split_with_sizes({q_width, q_width, v_width}, -1);
      Tensor q = parts[0].view({rows, 1, heads_, d_k_}).transpose(1, 2);
      Tensor k = parts[1].view({rows, 1, heads_, d_k_}).transpose(1, 2);
      Tensor v = parts[2].view({rows, 1, heads_, d_v_}).transpose(1, 2);
      std::optional<Tensor> spare_k, spare_v;
      if (!cache.spare.empty()) {
        spare_k = cache.spare[2 * i];
        spare_v = cache.spare[2 * i + 1];
      }
      auto [keys, key_buffer] = grow_cache(cache.self_kv[2 * i], k, cache.self_rows, spare_k);
      auto [values, value_buffer] =
          grow_cache(cache.self_kv[2 * i + 1], v, cache.self_rows, spare_v);
      Tensor context = attention_written_out(q, keys.transpose(-1, -2), values, nullptr);
      x = after(layer, 0, x, layer.self_out(context.transpose(1, 2).reshape({rows, 1, -1})));
      // encoder-decoder attention: the G = N / B beams of a source query it together
      h = pre_norm_ ? layer.norms[1](x) : x;
      const Tensor& memory_keys_t = cache.memory_kv[2 * i];
      Tensor queries = layer.cross_q(h).view({memory_keys_t.size(0), -1, heads_, d_k_})
                           .transpose(1, 2);
      context = attention_written_out(queries, memory_keys_t, cache.memory_kv[2 * i + 1],
                                      &cache.src_mask);
      x = after(layer, 1, x, layer.cross_out(context.transpose(1, 2).reshape({rows, 1, -1})));
      // feed-forward
      h = pre_norm_ ? layer.norms[2](x) : x;
      x = after(layer, 2, x, layer.outer(layer.inner(h)));
      grown.push_back(keys);
      grown.push_back(values);
      buffers.push_back(key_buffer);
      buffers.push_back(value_buffer);
    }
    if (final_norm_.has_value()) x = (*final_norm_)(x);
    // what a step before held becomes the spare the next one writes into (DecoderCache)
    cache.spare = std::move(cache.buffers);
    cache.buffers = std::move(buffers);
    cache.self_kv = std::move(grown);
    cache.self_rows.reset();
    cache.step += 1;
    return x.select(1, 0);
  }

 private:
  // model.Sublayers.after: the residual added, then (post-norm) the norm.
  Tensor after(const Layer& layer, int index, const Tensor& x, const Tensor& output) const {
    Tensor y = x + output;
    return pre_norm_ ? y : layer.norms[index](y);
  }

  int64_t heads_, d_k_, d_v_;
  bool pre_norm_;
  Tensor embedding_;
  double embed_scale_;
  int64_t pad_id_;
  std::vector<Layer> layers_;
  std::optional<Norm> final_norm_;
  Linear output_;
};


// ------------------------------------------------------------------ the search (search.py)

constexpr double kInf = std::numeric_limits<double>::infinity();

// search.topk_blocked: the k largest of the last dimension, through the k blocks of 64 whose
// maxima are largest.
std::tuple<Tensor, Tensor> topk_blocked(const Tensor& values, int64_t k, int64_t width = 64) {
  const int64_t size = values.size(-1), blocks = size / width;
  if (blocks <= 2 * k) {
    auto [top, indices] = values.topk(k, -1);
    return {top, indices};
  }
  Tensor body = values.slice(-1, 0, blocks * width).unflatten(-1, {blocks, width});
  Tensor chosen = std::get<1>(body.amax(-1).topk(k, -1));
  Tensor offsets = at::arange(width, values.options().dtype(at::kLong));
  Tensor columns = (chosen.unsqueeze(-1) * width + offsets).flatten(-2);
  if (blocks * width < size) {
    Tensor tail = at::arange(blocks * width, size, values.options().dtype(at::kLong));
    std::vector<int64_t> shape(columns.sizes().begin(), columns.sizes().end() - 1);
    shape.push_back(-1);
    columns = at::cat({columns, tail.expand(shape)}, -1);
  }
  auto [top, position] = values.gather(-1, columns).topk(k, -1);
  return {top, columns.gather(-1, position)};
}

// search.topk_over_beams: the best k extensions of every sentence's live beams.
std::tuple<Tensor, Tensor, Tensor> topk_over_beams(const Tensor& scores, const Tensor& log_probs,
                                                   int64_t k) {
  const int64_t batch = log_probs.size(0), beams = log_probs.size(1), vocab = log_probs.size(2);
  const int64_t per_beam = std::min(k, vocab);
  auto [top_log_probs, top_tokens] = topk_blocked(log_probs, per_beam);
  Tensor candidates = (scores.unsqueeze(-1) + top_log_probs).view({batch, -1});
  auto [best, flat] = candidates.topk(std::min(k, beams * per_beam), -1);
  if (best.size(1) < k) {
    const int64_t missing = k - best.size(1);
    best = at::cat({best, best.new_full({batch, missing}, -kInf)}, 1);
    flat = at::cat({flat, flat.slice(1, 0, 1).expand({batch, missing})}, 1);
  }
  return {best, at::div(flat, per_beam, "floor"), top_tokens.view({batch, -1}).gather(1, flat)};
}

// search.true_positions: mask.nonzero() of a 1-d mask holding `count` True values, in order.
Tensor true_positions(const Tensor& mask, int64_t count) {
  return std::get<1>(at::sort((~mask).to(at::kByte), /*stable=*/true, 0, false))
      .slice(0, 0, count);
}

// search.Stop's values, in formats.Stop's order.
enum StopRule : int64_t { kBound = 0, kPatience = 1, kBestEnds = 2, kLimit = 3 };

// search.Finished: each sentence's n best scores so far (float64), whether a step's best
// candidate has ended, how many hypotheses have, and the rows of those kept (finished_rows).
struct Finished {
  Tensor top, best_ended, ended;
  std::vector<Tensor> rows;

  Finished(int64_t sentences, int64_t nbest, const at::TensorOptions& device)
      : top(at::full({sentences, nbest}, -kInf, device.dtype(at::kDouble))),
        best_ended(at::zeros({sentences}, device.dtype(at::kBool))),
        ended(at::zeros({sentences}, device.dtype(at::kLong))) {}

  // Finished.collect: of the first K candidates, those ending that may be among their
  // sentence's n best (their scores join the n best now).
  Tensor collect(const Tensor& best, const Tensor& ends, const Tensor& active,
                 const Tensor& penalty, int64_t beam) {
    Tensor first = best.slice(1, 0, beam);
    Tensor ending = ends.slice(1, 0, beam) & first.gt(-kInf);
    Tensor scores = (first.to(at::kDouble) / penalty).masked_fill(~ending, -kInf);
    Tensor sentence_top = top.index({active});
    top.index_put_({active},
                   std::get<0>(at::cat({sentence_top, scores}, 1).topk(top.size(1), 1)));
    Tensor best_ended_now = best_ended.index({active});
    best_ended_now.bitwise_or_(ending.select(1, 0));
    best_ended.index_put_({active}, best_ended_now);
    Tensor ended_now = ended.index({active});
    ended_now.add_(ending.sum(1));
    ended.index_put_({active}, ended_now);
    return scores > sentence_top.slice(1, -1);
  }

  // Finished.keep: the `count` hypotheses `finishing` (B', K), their rows made now.
  void keep(const Tensor& finishing, int64_t count, const Tensor& best, const Tensor& origin,
            const Tensor& active, const Tensor& history, const Tensor& penalty) {
    if (count == 0) return;
    const int64_t beam = finishing.size(1);
    Tensor where = true_positions(finishing.flatten(), count);
    Tensor rows_of = at::div(where, beam, "floor"), ranks = at::remainder(where, beam);
    Tensor log_probs = best.index({rows_of, ranks}).to(at::kDouble);
    Tensor scores = log_probs / penalty;
    Tensor histories = history.index({rows_of, origin.index({rows_of, ranks})});
    rows.push_back(at::cat({active.index({rows_of}).unsqueeze(1).to(at::kDouble),
                            log_probs.unsqueeze(1).to(at::kDouble),
                            scores.unsqueeze(1).to(at::kDouble), histories.to(at::kDouble)},
                           1));
  }
};

// search.Beams: the live hypotheses, K per sentence still searching (one, BOS, to begin with).
struct Beams {
  Tensor scores, tokens, history, active;

  Beams(int64_t sentences, int64_t bos, const at::TensorOptions& device)
      : scores(at::zeros({sentences, 1}, device.dtype(at::kFloat))),
        tokens(at::full({sentences, 1}, bos, device.dtype(at::kLong))),
        history(at::empty({sentences, 1, 0}, device.dtype(at::kLong))),
        active(at::arange(sentences, device.dtype(at::kLong))) {}

  // Beams.advance: each new beam extends beam `parents` by `next_tokens`, of the sentences
  // `kept` only (none: all), the decoder's cache reordered to match.
  void advance(Tensor new_scores, Tensor parents, Tensor next_tokens,
               const std::optional<Tensor>& kept, Cache& cache) {
    Tensor rows = kept.has_value() ? *kept
                                   : at::arange(new_scores.size(0), active.options());
    if (kept.has_value()) {
      new_scores = new_scores.index({*kept});
      parents = parents.index({*kept});
      next_tokens = next_tokens.index({*kept});
      active = active.index({*kept});
    }
    history = at::cat({history.index({rows.unsqueeze(-1), parents}), next_tokens.unsqueeze(-1)},
                      -1);
    const int64_t cached_per_sentence = scores.size(1);  // 1 after BOS, then K
    cache.reorder((rows.unsqueeze(-1) * cached_per_sentence + parents).view(-1), kept);
    scores = std::move(new_scores);
    tokens = std::move(next_tokens);
  }
};

// search.CalledOff: the sentences whose search is called off, named by `cancelled()` (asked,
// the GIL taken, before each step's read), as a mask made at the first one named.
struct CalledOff {
  // a reference, not a copy: copying a Python object takes the GIL, which the search holds not
  const std::optional<pybind11::function>& cancelled;
  int64_t sentences;
  std::set<int64_t> named;
  std::optional<Tensor> mask;

  std::optional<Tensor> rows(const Tensor& active) {
    if (!cancelled.has_value()) return std::nullopt;
    std::vector<int64_t> now;
    {
      pybind11::gil_scoped_acquire gil;
      for (auto item : (*cancelled)()) now.push_back(item.cast<int64_t>());
    }
    for (int64_t sentence : now) {
      if (!named.insert(sentence).second) continue;
      if (!mask.has_value()) mask = at::zeros({sentences}, active.options().dtype(at::kBool));
      mask->select(0, sentence).fill_(true);
    }
    if (!mask.has_value()) return std::nullopt;
    return mask->index({active});
  }
};

// search.sentences_done: whether each sentence's search is over.
Tensor sentences_done(const Tensor& scores, const Tensor& kth_best, const Tensor& limit,
                      double alpha, int64_t beam, int64_t stop, const Tensor& best_ended,
                      const Tensor& ended) {
  Tensor live_best = scores.select(1, 0);
  Tensor done = live_best.eq(-kInf);
  if (beam == 1) return done | kth_best.gt(-kInf);
  if (stop == kBound) {  // search.can_stop, its length_penalty of the longest output
    Tensor penalty = at::pow(at::div(at::add(limit, 5.0), 6.0), alpha);
    return done | (live_best / penalty).le(kth_best);
  }
  if (stop == kPatience) return done | ended.ge(beam);
  if (stop == kBestEnds) return done | (best_ended & kth_best.gt(-kInf));
  return done;
}

std::vector<Tensor> Decoder::beam_search(
    const SearchBatch& batch, const Tensor& positions,
    const std::optional<pybind11::function>& cancelled) const {
  const int64_t sentences = batch.limits.size(0), beam = batch.beam;
  const auto& lengths = batch.limit_lengths;
  Cache cache{batch.src_mask, batch.memory_kv, batch.self_kv, std::nullopt, {}, {}, 0};
  Finished finished(sentences, batch.nbest, batch.limits.options());
  Beams live(sentences, batch.bos_id, batch.limits.options());
  CalledOff called_off{cancelled, sentences, {}, std::nullopt};
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  for (int64_t step = 0; step < longest; ++step) {
    Tensor hidden = hidden_step(live.tokens.view(-1), positions.narrow(0, step, 1), cache);
    Tensor logits = batch.output.has_value() ? (*batch.output)(hidden) : output_(hidden);
    // Setup.log_probs: the banned columns -inf
    Tensor log_probs = at::log_softmax(logits.to(at::kFloat), -1)
                           .index_fill_(-1, batch.banned, -kInf)
                           .view({live.scores.size(0), live.scores.size(1), -1});
    Tensor limit = batch.limits.index({live.active});
    Tensor at_limit = limit.le(step + 1);
    if (std::find(lengths.begin(), lengths.end(), step + 1) != lengths.end()) {
      // search.only_eos_at_limit
      Tensor eos = log_probs.select(-1, batch.eos_column).clone();
      log_probs.masked_fill_(at_limit.unsqueeze(-1).unsqueeze(-1), -kInf);
      log_probs.select(-1, batch.eos_column).copy_(eos);
    }
    auto [best, origin, picked] = topk_over_beams(live.scores, log_probs, 2 * beam);
    Tensor tokens = batch.column_ids.has_value() ? batch.column_ids->index({picked}) : picked;
    Tensor ends = tokens.eq(batch.eos_id);
    Tensor penalty = batch.penalties.select(0, live.history.size(2) + 1);
    Tensor finishing = finished.collect(best, ends, live.active, penalty, beam);
    // search.first_not_ending: the first K candidates not ending live on
    Tensor chosen = std::get<1>(at::sort(ends.to(at::kByte), true, 1, false)).slice(1, 0, beam);
    Tensor scores = best.gather(1, chosen);
    Tensor done = sentences_done(scores, finished.top.select(1, -1).to(at::kFloat)
                                     .index({live.active}),
                                 limit, batch.alpha, beam, batch.stop,
                                 finished.best_ended.index({live.active}),
                                 finished.ended.index({live.active}));
    if (auto leaving = called_off.rows(live.active)) done = done | *leaving;
    // the step's one read: how many finish, how many sentences go on
    const int64_t finishing_count = finishing.sum().item<int64_t>();
    Tensor going_on = ~done;
    const int64_t kept_count = going_on.sum().item<int64_t>();
    finished.keep(finishing, finishing_count, best, origin, live.active, live.history, penalty);
    if (kept_count == 0) break;
    std::optional<Tensor> kept;
    if (kept_count != done.size(0)) kept = true_positions(going_on, kept_count);
    live.advance(scores, origin.gather(1, chosen), tokens.gather(1, chosen), kept, cache);
  }
  return finished.rows;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  namespace py = pybind11;
  py::class_<Linear>(module, "Linear")
      .def(py::init([](bool packed, Tensor weight, std::optional<Tensor> bias,
                       std::string activation) {
             return Linear{packed ? Linear::kPacked : Linear::kDense, std::move(weight),
                           std::move(bias), std::move(activation)};
           }),
           py::arg("packed"), py::arg("weight"), py::arg("bias"), py::arg("activation"))
      .def_static(
          "int8",
          [](Tensor weight, std::optional<Tensor> bias, bool reduce_range,
             std::string activation) {
            // packed again here from the layer's int8 weight and bias (the same packing
            // torch's layer holds, made by the same op)
            static auto prepack =
                c10::Dispatcher::singleton().findSchemaOrThrow("quantized::linear_prepack", "");
            torch::jit::Stack stack{weight, bias};
            prepack.callBoxed(&stack);
            Linear linear;
            linear.kind = Linear::kInt8;
            linear.params = stack[0];
            linear.reduce_range = reduce_range;
            linear.activation = std::move(activation);
            return linear;
          },
          py::arg("weight"), py::arg("bias"), py::arg("reduce_range"), py::arg("activation"))
      .def("__call__", &Linear::operator(), py::call_guard<py::gil_scoped_release>());
  py::class_<Norm>(module, "Norm")
      .def(py::init([](Tensor weight, Tensor bias, double eps) {
             return Norm{std::move(weight), std::move(bias), eps};
           }),
           py::arg("weight"), py::arg("bias"), py::arg("eps"));
  py::class_<Decoder>(module, "Decoder")
      .def(py::init<int64_t, int64_t, int64_t, bool, Tensor, double, int64_t, std::vector<Linear>,
                    std::vector<Norm>, std::optional<Norm>, Linear>(),
           py::arg("heads"), py::arg("d_k"), py::arg("d_v"), py::arg("pre_norm"),
           py::arg("embedding"), py::arg("embed_scale"), py::arg("pad_id"), py::arg("linears"),
           py::arg("norms"), py::arg("final_norm"), py::arg("output"))
      .def("step", &Decoder::step, py::call_guard<py::gil_scoped_release>())
      .def(
          "beam_search",
          [](const Decoder& decoder, Tensor src_mask, std::vector<Tensor> memory_kv,
             std::vector<Tensor> self_kv, std::optional<Linear> output,
             std::optional<Tensor> column_ids, Tensor limits, std::vector<int64_t> limit_lengths,
             Tensor banned, Tensor penalties, int64_t eos_column, int64_t eos_id, int64_t bos_id,
             int64_t beam, int64_t nbest, int64_t stop, double alpha, Tensor positions,
             std::optional<py::function> cancelled) {
            SearchBatch batch{std::move(src_mask), std::move(memory_kv), std::move(self_kv),
                              std::move(output), std::move(column_ids), std::move(limits),
                              std::move(limit_lengths), std::move(banned), std::move(penalties),
                              eos_column, eos_id, bos_id, beam, nbest, stop, alpha};
            py::gil_scoped_release released;
            return decoder.beam_search(batch, positions, cancelled);
          },
          py::arg("src_mask"), py::arg("memory_kv"), py::arg("self_kv"), py::arg("output"),
          py::arg("column_ids"), py::arg("limits"), py::arg("limit_lengths"), py::arg("banned"),
          py::arg("penalties"), py::arg("eos_column"), py::arg("eos_id"), py::arg("bos_id"),
          py::arg("beam"), py::arg("nbest"), py::arg("stop"), py::arg("alpha"),
          py::arg("positions"), py::arg("cancelled"));
}
