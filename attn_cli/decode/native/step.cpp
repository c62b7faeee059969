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

#include "kernels.h"

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

// The fused step's self-attention keys and values (stage B): per layer (positions, slots, D)
// float32, the key and value of position s written once, where they are made, into a slot of
// position s's block, and never moved; a hypothesis's past is read through its origin, the
// slot of each of its positions. A beam reorder copies origins (an int a position) where
// Cache.reorder's next step copies every layer's whole cache. A batch has one such store (a
// slot a row); a Stream's sentence its own (a slot a beam), sized to its own limit, made when
// it joins and freed when it leaves.
struct KVStore {
  std::vector<Tensor> tensors;             // per layer: keys, values
  std::vector<float*> keys, values;        // their data
  int64_t slots = 0;

  KVStore() = default;
  KVStore(int64_t layers, int64_t key_width, int64_t value_width, int64_t positions,
          int64_t slot_count, const at::TensorOptions& options)
      : slots(slot_count) {
    for (int64_t i = 0; i < layers; ++i) {
      tensors.push_back(at::empty({positions, slots, key_width}, options.dtype(at::kFloat)));
      tensors.push_back(at::empty({positions, slots, value_width}, options.dtype(at::kFloat)));
      keys.push_back(tensors[2 * i].data_ptr<float>());
      values.push_back(tensors[2 * i + 1].data_ptr<float>());
    }
  }
};

// One row of a fused step as its kernels read it: its position (how many before it), the
// slot its key and value at that position are written to, its origin (its slots at positions
// 0..position, the last one `slot`), its sentence (its place in the step's memory views) and
// the store its keys and values are in.
struct RowView {
  int64_t position, slot;
  const int32_t* origin;
  int64_t sentence;
  const KVStore* store;
};

// A sentence's encoder-decoder keys (transposed, (H, d_k, S)) and values ((H, S, d_v)) in
// one layer, and its mask (0, or -inf at padding; none: no padding).
struct MemoryView {
  const float* keys_t;
  const float* values;
  int64_t length;
  const float* mask;
};

// The fused step's cache of one batch (its tests' and benchmarks'): a KVStore in which row r of the
// step at position t writes slot r (each position's block is written by one step only), the
// rows' origins, and the source side (memory_kv, src_mask) as Cache's.
struct PositionCache {
  Tensor src_mask;
  std::vector<Tensor> memory_kv;
  KVStore store;
  std::vector<int32_t> origin, spare_origin;  // rows_capacity x capacity
  int64_t capacity = 0, rows_capacity = 0, length = 0;

  PositionCache(Tensor mask, std::vector<Tensor> memory, int64_t layers, int64_t key_width,
                int64_t value_width, int64_t positions, int64_t most_rows)
      : src_mask(std::move(mask)), memory_kv(std::move(memory)),
        store(layers, key_width, value_width, positions, most_rows,
              memory_kv.front().options()),
        capacity(positions), rows_capacity(most_rows) {
    origin.resize(rows_capacity * capacity);
    spare_origin.resize(rows_capacity * capacity);
  }

  // The next step's hypotheses continue rows `rows` (a long tensor) of this one, of the
  // sentences `sources` (none: the same), as Cache.reorder.
  void reorder(const Tensor& rows_now, const std::optional<Tensor>& sources) {
    const int64_t* from = rows_now.data_ptr<int64_t>();
    const int64_t count = rows_now.numel();
    TORCH_CHECK(count <= rows_capacity, "more hypotheses than the cache holds");
    for (int64_t i = 0; i < count; ++i)
      std::copy_n(origin.data() + from[i] * capacity, length,
                  spare_origin.data() + i * capacity);
    std::swap(origin, spare_origin);
    if (!sources.has_value()) return;
    for (Tensor& tensor : memory_kv) tensor = tensor.index_select(0, *sources);
    src_mask = src_mask.index_select(0, *sources);
  }

  // The views of a step of `rows` rows (G = rows / B per sentence, in order), each row's
  // origin at this position set to its slot; `memory`: per layer, per sentence.
  std::vector<RowView> views(int64_t rows, std::vector<MemoryView>& memory) {
    TORCH_CHECK(rows <= rows_capacity && length < capacity, "the fused step's cache is full");
    const int64_t sentences = memory_kv.front().size(0), group = rows / sentences;
    std::vector<RowView> found(rows);
    for (int64_t r = 0; r < rows; ++r) {
      int32_t* row_origin = origin.data() + r * capacity;
      row_origin[length] = static_cast<int32_t>(r);
      found[r] = {length, r, row_origin, r / group, &store};
    }
    TORCH_CHECK(src_mask.scalar_type() == at::kFloat && src_mask.stride(3) == 1,
                "the fused step reads a float32 mask");
    const float* mask = src_mask.data_ptr<float>();
    memory.clear();
    for (size_t layer = 0; layer < memory_kv.size() / 2; ++layer) {
      const Tensor& keys_t = memory_kv[2 * layer];
      const Tensor& values = memory_kv[2 * layer + 1];
      TORCH_CHECK(keys_t.is_contiguous() && values.is_contiguous() &&
                      keys_t.scalar_type() == at::kFloat,
                  "the fused step reads contiguous float32 memory");
      const int64_t source = keys_t.size(3);
      for (int64_t b = 0; b < sentences; ++b)
        memory.push_back({keys_t.data_ptr<float>() + b * keys_t.stride(0),
                          values.data_ptr<float>() + b * values.stride(0), source,
                          mask + b * src_mask.stride(0)});
    }
    return found;
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
        final_norm_(std::move(final_norm)), output_(std::move(output)),
        query_scale_(static_cast<float>(std::pow(static_cast<double>(d_k), -0.5))) {
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
  // `fused`: with stage B's kernels (fused_beam_search) where the decoder is fusable: the
  // same search, its scores equal to float rounding.
  std::vector<Tensor> beam_search(const SearchBatch& batch, const Tensor& positions,
                                  const std::optional<pybind11::function>& cancelled,
                                  bool fused) const;

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

 public:
  // fused_hidden_step's logits (the model's output projection): the fused step alone, for
  // its tests and benchmarks/decode_steps.py.
  Tensor fused_step(const Tensor& tokens, const Tensor& positions, PositionCache& cache) const {
    TORCH_CHECK(fusable(), "the fused step computes float32 decoders");
    return output_(fused_hidden_step(tokens, positions, cache));
  }

  size_t layer_count() const { return layers_.size(); }
  int64_t key_width() const { return heads_ * d_k_; }
  int64_t value_width() const { return heads_ * d_v_; }

  // fused_layers' logits, float32 (N, V): through `output` (a shortlist's projection) or the
  // model's.
  Tensor fused_logits(const int64_t* tokens, const std::vector<RowView>& rows,
                      const std::vector<MemoryView>& memory, int64_t sentences,
                      const Tensor& positions, const std::optional<Linear>& output) const {
    Tensor hidden = padded_layers(tokens, rows, memory, sentences, positions);
    Tensor logits = output.has_value() ? (*output)(hidden) : output_(hidden);
    return logits.to(at::kFloat).contiguous().narrow(0, 0, static_cast<int64_t>(rows.size()));
  }

  // The rows the fused step's linear layers run on: `count` rounded up to a multiple of 8 above
  // 32. oneDNN makes (and JIT-compiles) a kernel for each new number of rows, and a stream's
  // row count changes nearly every step; the padding costs a few rows of hundreds. (The
  // kernels' cost and the count before and after: benchmarks/README.md, issue 53's third
  // session.)
  static int64_t padded_rows(int64_t count) { return count <= 32 ? count : (count + 7) / 8 * 8; }

  // Whether the fused step computes this decoder (stage B): float32 weights (its kernels are
  // float32 loops; bf16 keeps the ATen step).
  bool fusable() const { return embedding_.scalar_type() == at::kFloat; }

  // hidden_step with stage B's kernels: the same linear layers; the embedding, both
  // attentions (one query per row and head: scores, softmax and weighted sum in one pass, the
  // self-attention's past read through each row's origin, the encoder-decoder attention from
  // its sentence's memory) and each residual with its LayerNorm as loops over rows. Rows may
  // be at different positions (iteration-level batching: Stream). tokens (N); `memory`: per
  // layer, per sentence (`sentences` each); `positions`: the position table (P, D).
  Tensor fused_layers(const int64_t* tokens, const std::vector<RowView>& rows,
                      const std::vector<MemoryView>& memory, int64_t sentences,
                      const Tensor& positions) const {
    return padded_layers(tokens, rows, memory, sentences, positions)
        .narrow(0, 0, static_cast<int64_t>(rows.size()));
  }

  // fused_layers on padded_rows(N) rows, the rows past N zeros going in (their outputs
  // finite and unused).
  Tensor padded_layers(const int64_t* tokens, const std::vector<RowView>& rows,
                       const std::vector<MemoryView>& memory, int64_t sentences,
                       const Tensor& positions) const {
    const int64_t count = static_cast<int64_t>(rows.size()), width = embedding_.size(1);
    const int64_t q_width = heads_ * d_k_, v_width = heads_ * d_v_;
    const int64_t padded = padded_rows(count);
    // (padded, columns), its rows past `count` zeros
    auto rows_padded = [&](int64_t columns) {
      Tensor made = at::empty({padded, columns}, embedding_.options());
      made.narrow(0, count, padded - count).zero_();
      return made;
    };
    Tensor x = rows_padded(width);
    {
      const float* table = embedding_.data_ptr<float>();
      const float* where = positions.data_ptr<float>();
      TORCH_CHECK(positions.is_contiguous() && positions.size(1) == width,
                  "a (P, D) position table");
      float* out = x.data_ptr<float>();
      const float scale = static_cast<float>(embed_scale_);
      for (int64_t r = 0; r < count; ++r) {
        TORCH_CHECK(rows[r].position < positions.size(0), "a position beyond the table");
        const float* e = table + tokens[r] * width;
        const float* p = where + rows[r].position * width;
        float* o = out + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) o[i] = e[i] * scale + p[i];
      }
    }
    Tensor h = pre_norm_ ? at::empty_like(x) : x;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      // self-attention: this step's keys and values written to each row's slot, then read
      // with every earlier position's through its origin
      if (pre_norm_) norm_rows(layer.norms[0], x, h);
      Tensor qkv = layer.qkv(h).contiguous();
      const float* made = qkv.data_ptr<float>();
      const int64_t stride = qkv.size(1);
      for (int64_t r = 0; r < count; ++r) {
        const KVStore& store = *rows[r].store;
        const int64_t at = rows[r].position * store.slots + rows[r].slot;
        std::copy_n(made + r * stride + q_width, q_width, store.keys[i] + at * q_width);
        std::copy_n(made + r * stride + 2 * q_width, v_width, store.values[i] + at * v_width);
      }
      Tensor context = rows_padded(v_width);
      self_attention(made, stride, i, rows, context.data_ptr<float>());
      residual(layer, 0, x, layer.self_out(context));
      // encoder-decoder attention
      if (pre_norm_) norm_rows(layer.norms[1], x, h);
      Tensor queries = layer.cross_q(h).contiguous();
      context = rows_padded(v_width);
      cross_attention(queries.data_ptr<float>(), memory.data() + i * sentences, rows,
                      context.data_ptr<float>());
      residual(layer, 1, x, layer.cross_out(context));
      // feed-forward
      if (pre_norm_) norm_rows(layer.norms[2], x, h);
      residual(layer, 2, x, layer.outer(layer.inner(h)));
    }
    if (final_norm_.has_value()) {
      Tensor out = at::empty_like(x);
      norm_rows(*final_norm_, x, out);
      x = out;
    }
    return x;
  }

  // fused_layers of a batch's step into its PositionCache, which grows by one position.
  Tensor fused_hidden_step(const Tensor& tokens, const Tensor& positions,
                           PositionCache& cache) const {
    std::vector<MemoryView> memory;
    const std::vector<RowView> rows = cache.views(tokens.size(0), memory);
    Tensor ids = tokens.to(at::kLong).contiguous();
    Tensor hidden = fused_layers(ids.data_ptr<int64_t>(), rows, memory,
                                 cache.memory_kv.front().size(0), positions);
    cache.length += 1;
    return hidden;
  }

  // One sentence's part of a step's logits into its search: log_softmax over each of its G
  // rows (N × V float32, from `rows`), the banned columns -inf (at its limit, every column but
  // EOS's), each beam's best per_beam = min(k, V) extensions, and the best k of its G ×
  // per_beam: search.py's Setup.log_probs, only_eos_at_limit and topk_over_beams in one pass
  // over the logits. Writes best (k), the beams they extend (origin) and their columns
  // (picked), as topk_over_beams returns them.
  // `forced` >= 0: the one column every row may take (decode/prefix.py's PrefixConstraint: a
  // piece of the sentence's prefix, its own log-probability kept; none at the limit).
  static void sentence_top_k(const float* rows, int64_t group, int64_t vocab,
                             const float* scores, const bool* banned, bool at_limit,
                             int64_t eos_column, int64_t k, float* best, int64_t* origin,
                             int64_t* picked, int64_t forced = -1) {
    using namespace attn_kernels;
    const int64_t per_beam = std::min(k, vocab), width = group * per_beam;
    std::vector<float> candidates(width), top(per_beam), maxima(vocab / kBlock);
    std::vector<int64_t> tokens(width), columns(per_beam), flat(k);
    for (int64_t g = 0; g < group; ++g) {
      const float* x = rows + g * vocab;
      const float shift = block_maxima(x, vocab, maxima.data());
      const float log_sum = std::log(sum_exp(x, shift, vocab));
      if (at_limit || forced >= 0) {  // only EOS may end a hypothesis at its limit
        const int64_t only = at_limit ? eos_column : forced;
        std::fill(top.begin(), top.end(), kMinusInf);
        std::fill(columns.begin(), columns.end(), 0);
        if (banned == nullptr || !banned[only]) top[0] = x[only];
        columns[0] = only;
      } else {
        top_k(x, vocab, per_beam, banned, top.data(), columns.data(), maxima.data());
      }
      for (int64_t j = 0; j < per_beam; ++j) {
        candidates[g * per_beam + j] = scores[g] + ((top[j] - shift) - log_sum);
        tokens[g * per_beam + j] = columns[j];
      }
    }
    top_k(candidates.data(), width, k, nullptr, best, flat.data());
    for (int64_t j = 0; j < k; ++j) {
      origin[j] = flat[j] / per_beam;
      picked[j] = tokens[flat[j]];
    }
  }

  // beam_search with stage B's kernels: the fused step, sentence_top_k, and the
  // search's bookkeeping (Finished, Beams, first_not_ending, sentences_done, as the ATen
  // search below has them) as loops over a few host arrays instead of ~60 small tensor ops a
  // step. The same rules in the same order; scores computed as there (float32 sums, float64
  // penalties), so the same hypotheses but where two tie to float rounding.
  std::vector<Tensor> fused_beam_search(const SearchBatch& batch, const Tensor& positions,
                                        const std::optional<pybind11::function>& cancelled)
      const;

 private:
  // out = norm(x), row by row
  static void norm_rows(const Norm& norm, const Tensor& x, Tensor& out) {
    const int64_t rows = x.size(0), width = x.size(1);
    const float* in = x.data_ptr<float>();
    float* to = out.data_ptr<float>();
    const float* weight = norm.weight.data_ptr<float>();
    const float* bias = norm.bias.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      attn_kernels::layer_norm(in + r * width, weight, bias, static_cast<float>(norm.eps), width,
                               to + r * width);
  }

  // x = norm(x + y) (post-norm) or x += y (pre-norm), in place, row by row
  void residual(const Layer& layer, int index, Tensor& x, const Tensor& y) const {
    const int64_t rows = x.size(0), width = x.size(1);
    Tensor sublayer = y.contiguous();
    float* to = x.data_ptr<float>();
    const float* add = sublayer.data_ptr<float>();
    if (pre_norm_) {
      for (int64_t r = 0; r < rows; ++r) attn_kernels::axpy(1.0f, add + r * width, to + r * width, width);
      return;
    }
    const Norm& norm = layer.norms[index];
    const float* weight = norm.weight.data_ptr<float>();
    const float* bias = norm.bias.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      attn_kernels::add_layer_norm(to + r * width, add + r * width, weight, bias,
                                   static_cast<float>(norm.eps), width);
  }

  // Both attentions' last part for one row and head: softmax over `scores` (in place), then
  // out (d_v) = the sum of the values (`value_at(s)`: position s's) so weighted.
  template <typename ValueAt>
  void weigh_values(std::vector<float>& scores, float* out, ValueAt value_at) const {
    const int64_t length = static_cast<int64_t>(scores.size());
    attn_kernels::softmax(scores.data(), length);
    attn_kernels::weighted_sum(scores.data(), length, value_at, out, d_v_);
  }

  // One query per row and head against its positions 0..position in layer `layer`'s store:
  // softmax(q k_s / sqrt(d_k)) over s, the softmax in float32, then the sum of the values so
  // weighted, written to context (rows, H × d_v) heads side by side (the layout the output
  // projection reads, with no transpose).
  void self_attention(const float* qkv, int64_t stride, size_t layer,
                      const std::vector<RowView>& rows, float* context) const {
    using namespace attn_kernels;
    const int64_t q_width = heads_ * d_k_, v_width = heads_ * d_v_;
    std::vector<float> scores;
    for (size_t r = 0; r < rows.size(); ++r) {
      const KVStore& store = *rows[r].store;
      const float* keys = store.keys[layer];
      const float* values = store.values[layer];
      const int32_t* origin = rows[r].origin;
      const int64_t length = rows[r].position + 1;
      scores.resize(length);
      for (int64_t head = 0; head < heads_; ++head) {
        const float* q = qkv + r * stride + head * d_k_;
        for (int64_t s = 0; s < length; ++s) {
          const float* k = keys + (s * store.slots + origin[s]) * q_width + head * d_k_;
          scores[s] = dot(q, k, d_k_) * query_scale_;
        }
        weigh_values(scores, context + r * v_width + head * d_v_, [&](int64_t s) {
          return values + (s * store.slots + origin[s]) * v_width + head * d_v_;
        });
      }
    }
  }

  // The encoder-decoder attention: row r's query against its sentence's keys and values
  // (`memory`, this layer's views by sentence), its mask added to the scores.
  void cross_attention(const float* queries, const MemoryView* memory,
                       const std::vector<RowView>& rows, float* context) const {
    using namespace attn_kernels;
    const int64_t q_width = heads_ * d_k_, v_width = heads_ * d_v_;
    std::vector<float> scores;
    for (size_t r = 0; r < rows.size(); ++r) {
      const MemoryView& source = memory[rows[r].sentence];
      const int64_t length = source.length;
      scores.resize(length);
      for (int64_t head = 0; head < heads_; ++head) {
        const float* q = queries + r * q_width + head * d_k_;
        const float* k = source.keys_t + head * d_k_ * length;
        scores_transposed(q, k, length, d_k_, scores.data());
        if (source.mask != nullptr) {
#pragma omp simd
          for (int64_t s = 0; s < length; ++s) scores[s] = scores[s] * query_scale_ + source.mask[s];
        } else {
#pragma omp simd
          for (int64_t s = 0; s < length; ++s) scores[s] = scores[s] * query_scale_;
        }
        const float* v = source.values + head * length * d_v_;
        weigh_values(scores, context + r * v_width + head * d_v_,
                     [&](int64_t s) { return v + s * d_v_; });
      }
    }
  }

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
  float query_scale_;  // 1 / sqrt(d_k), the fused attentions' (the ATen step computes its own)
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
  // `kept` only (none: all). Returns the rows of this step's hypotheses the next one
  // continues, for the decoder's cache (DecoderCache.reorder).
  Tensor advance(Tensor new_scores, Tensor parents, Tensor next_tokens,
                 const std::optional<Tensor>& kept) {
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
    scores = std::move(new_scores);
    tokens = std::move(next_tokens);
    return (rows.unsqueeze(-1) * cached_per_sentence + parents).view(-1);
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
    const std::optional<pybind11::function>& cancelled, bool fused) const {
  if (fused && fusable()) return fused_beam_search(batch, positions, cancelled);
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
    cache.reorder(live.advance(scores, origin.gather(1, chosen), tokens.gather(1, chosen), kept),
                  kept);
  }
  return finished.rows;
}

// ------------------------------------------------- iteration-level batching (issue 53, 2)

// One sentence of a Stream: its hypotheses (G: one, BOS, at first, then K), their scores,
// last tokens, histories (G × length) and slots' origins (K × limit: the slot of each of
// their positions); its encoder-decoder memory; search.Finished's part of it (its n best
// scores, whether a step's best candidate ended, how many ended) and the rows found.
struct Flight {
  int64_t key, limit;
  std::vector<int64_t> prefix;     // the columns its output starts with (decode/prefix.py)
  KVStore store;                   // its self-attention keys and values: limit × K slots
  std::vector<Tensor> memory;      // per layer: keys (transposed), values (held for the views)
  std::vector<MemoryView> views;   // per layer
  Tensor mask;                     // (S) where its memory is padded
  int64_t length = 0, group = 1;
  std::vector<float> scores;
  std::vector<int64_t> tokens, history;
  std::vector<int32_t> origin, spare_origin;
  std::vector<double> top;
  float longest_penalty = 1.0f;    // the length penalty at `limit` (search.can_stop's)
  bool best_ended = false, called_off = false;
  int64_t ended = 0;
  std::vector<Tensor> found;       // search.finished_rows's rows, column 0 the key
};

// A free beam search that sentences join and leave at any step (iteration-level batching,
// Orca's and vLLM's scheduling for an encoder-decoder): each step is one fused decoder step
// of every hypothesis in flight, whatever its position; a sentence added joins at the next
// step (its memory from an encoder pass of its own batch), and one whose search is over
// leaves at that step with its rows, the others going on. Each sentence's search is
// beam_search's for it alone: the same rules (search.py) over its own scores, its rows
// written to its own slots, so what it finds does not depend on what it flew with.
class Stream {
 public:
  Stream(const Decoder& decoder, int64_t beam, int64_t nbest, int64_t stop, double alpha,
         int64_t eos_id, int64_t bos_id, int64_t eos_column, Tensor banned,
         std::optional<Tensor> column_ids, std::optional<Linear> output)
      : decoder_(decoder), beam_(beam), nbest_(nbest), stop_(stop), alpha_(alpha),
        eos_id_(eos_id), bos_id_(bos_id), eos_column_(eos_column),
        banned_ids_(banned.to(at::kLong).contiguous()), output_(std::move(output)) {
    if (column_ids.has_value()) column_ids_ = column_ids->to(at::kLong).contiguous();
  }

  // A sentence joins at the next step: `memory`, per layer its encoder-decoder keys
  // (transposed, (H, d_k, S)) and values ((H, S, d_v)) and, if padded, `mask` (S) (0, or
  // -inf at padding; undefined: none); `limit`, its longest output, EOS included; `prefix`,
  // the target ids its output starts with (none: a free search), each forced as
  // decode/prefix.py's PrefixConstraint forces it.
  void add(int64_t key, std::vector<Tensor> memory, const std::optional<Tensor>& mask,
           int64_t limit, std::vector<int64_t> prefix) {
    TORCH_CHECK(prefix.empty() || !column_ids_.defined(),
                "a stream over a shortlist's columns forces no prefix");
    Flight flight;
    flight.key = key;
    flight.limit = limit;
    flight.prefix = std::move(prefix);
    flight.memory = std::move(memory);
    if (mask.has_value()) flight.mask = mask->to(at::kFloat).contiguous();
    const float* mask_data = mask.has_value() ? flight.mask.data_ptr<float>() : nullptr;
    TORCH_CHECK(flight.memory.size() == 2 * decoder_.layer_count(),
                "a sentence's memory: keys and values for every decoder layer");
    for (size_t layer = 0; layer < decoder_.layer_count(); ++layer) {
      const Tensor& keys_t = flight.memory[2 * layer];
      const Tensor& values = flight.memory[2 * layer + 1];
      TORCH_CHECK(keys_t.is_contiguous() && values.is_contiguous() &&
                      keys_t.scalar_type() == at::kFloat && keys_t.dim() == 3 &&
                      values.scalar_type() == at::kFloat,
                  "a sentence's memory: contiguous float32 (H, d_k, S) keys and values");
      flight.views.push_back({keys_t.data_ptr<float>(), values.data_ptr<float>(),
                              keys_t.size(2), mask_data});
    }
    flight.store = KVStore(static_cast<int64_t>(decoder_.layer_count()), decoder_.key_width(),
                           decoder_.value_width(), limit, beam_, at::dtype(at::kFloat));
    flight.scores.assign(1, 0.0f);
    flight.tokens.assign(1, bos_id_);
    flight.origin.resize(beam_ * limit);
    flight.spare_origin.resize(beam_ * limit);
    flight.top.assign(nbest_, -kInf);
    flight.longest_penalty = std::pow((static_cast<float>(limit) + 5.0f) / 6.0f,
                                      static_cast<float>(alpha_));
    flights_.push_back(std::move(flight));
  }

  // Call off the sentence `key`: it leaves at the next step with what it found so far.
  void call_off(int64_t key) {
    for (Flight& flight : flights_)
      if (flight.key == key) flight.called_off = true;
  }

  int64_t sentences() const { return static_cast<int64_t>(flights_.size()); }

  int64_t rows() const {
    int64_t count = 0;
    for (const Flight& flight : flights_) count += flight.group;
    return count;
  }

  // One step of every sentence in flight (`positions`: the position table, as long as the
  // longest limit). Returns the sentences whose search ended, each with its rows.
  std::vector<std::pair<int64_t, std::vector<Tensor>>> step(const Tensor& positions) {
    std::vector<std::pair<int64_t, std::vector<Tensor>>> ended;
    if (flights_.empty()) return ended;
    const Tensor table = positions.to(at::kFloat).contiguous();
    std::vector<RowView> rows;
    std::vector<int64_t> tokens;
    const size_t layers = decoder_.layer_count();
    std::vector<MemoryView> memory(layers * flights_.size());
    for (size_t f = 0; f < flights_.size(); ++f) {
      Flight& flight = flights_[f];
      for (int64_t g = 0; g < flight.group; ++g) {
        int32_t* origin = flight.origin.data() + g * flight.limit;
        origin[flight.length] = static_cast<int32_t>(g);
        rows.push_back({flight.length, g, origin, static_cast<int64_t>(f), &flight.store});
        tokens.push_back(flight.tokens[g]);
      }
      for (size_t layer = 0; layer < layers; ++layer)
        memory[layer * flights_.size() + f] = flight.views[layer];
    }
    Tensor logits = decoder_.fused_logits(tokens.data(), rows, memory,
                                          static_cast<int64_t>(flights_.size()), table,
                                          output_);
    if (banned_.empty()) {
      banned_.assign(logits.size(1), 0);
      for (int64_t i = 0; i < banned_ids_.numel(); ++i)
        banned_[banned_ids_.data_ptr<int64_t>()[i]] = 1;
    }
    const float* values = logits.data_ptr<float>();
    std::vector<Flight> going_on;
    for (Flight& flight : flights_) {
      const int64_t group = flight.group;  // its rows of this step's logits
      const bool over = advance(flight, values, logits.size(1));
      values += group * logits.size(1);
      if (over) {
        ended.emplace_back(flight.key, std::move(flight.found));
      } else {
        going_on.push_back(std::move(flight));
      }
    }
    flights_ = std::move(going_on);
    return ended;
  }

 private:
  // search.py's step for one sentence, its G rows of logits at `rows`: its top 2K
  // (sentence_top_k), Finished.collect, first_not_ending, sentences_done, Finished.keep and
  // Beams.advance. Whether its search is over.
  bool advance(Flight& flight, const float* rows, int64_t vocab) {
    const int64_t beam = beam_, k = 2 * beam, group = flight.group;
    std::vector<float> best(k);
    std::vector<int64_t> origin(k), picked(k);
    const int64_t forced = flight.length < static_cast<int64_t>(flight.prefix.size())
                               ? flight.prefix[flight.length]
                               : -1;
    Decoder::sentence_top_k(rows, group, vocab, flight.scores.data(),
                            reinterpret_cast<const bool*>(banned_.data()),
                            flight.limit <= flight.length + 1, eos_column_, k, best.data(),
                            origin.data(), picked.data(), forced);
    if (column_ids_.defined()) {
      const int64_t* ids = column_ids_.data_ptr<int64_t>();
      for (int64_t& column : picked) column = ids[column];
    }
    const double penalty = std::pow((5.0 + static_cast<double>(flight.length + 1)) / 6.0,
                                    alpha_);
    // Finished.collect: of the first K candidates, those ending that may be among the n best
    const double nth_before = flight.top[nbest_ - 1];
    std::vector<double> merged(flight.top);
    std::vector<char> finishing(beam, 0);
    int64_t ending_count = 0;
    for (int64_t j = 0; j < beam; ++j) {
      const bool ending = picked[j] == eos_id_ && best[j] > -kInf;
      const double score = ending ? static_cast<double>(best[j]) / penalty : -kInf;
      merged.push_back(score);
      finishing[j] = score > nth_before;
      ending_count += ending;
      if (j == 0 && ending) flight.best_ended = true;
    }
    std::partial_sort(merged.begin(), merged.begin() + nbest_, merged.end(),
                      std::greater<double>());
    std::copy_n(merged.begin(), nbest_, flight.top.begin());
    flight.ended += ending_count;
    // first_not_ending: the first K candidates not ending (then, if fewer, ending ones)
    std::vector<int64_t> chosen;
    for (int pass = 0; pass < 2; ++pass)
      for (int64_t j = 0; j < k && static_cast<int64_t>(chosen.size()) < beam; ++j)
        if ((picked[j] == eos_id_) == (pass == 1)) chosen.push_back(j);
    // sentences_done
    const float live_best = best[chosen[0]];
    const float kth_best = static_cast<float>(flight.top[nbest_ - 1]);
    bool over = live_best == -std::numeric_limits<float>::infinity();
    if (beam == 1) {
      over = over || kth_best > -kInf;
    } else if (stop_ == kBound) {  // search.can_stop at the longest output's penalty
      over = over || live_best / flight.longest_penalty <= kth_best;
    } else if (stop_ == kPatience) {
      over = over || flight.ended >= beam;
    } else if (stop_ == kBestEnds) {
      over = over || (flight.best_ended && kth_best > -kInf);
    }
    over = over || flight.called_off;
    // Finished.keep: each hypothesis finishing, as (key, log-prob, score, its tokens)
    int64_t finishing_count = 0;
    for (char each : finishing) finishing_count += each;
    const int64_t length = flight.length;
    if (finishing_count > 0) {
      Tensor found = at::empty({finishing_count, 3 + length}, at::dtype(at::kDouble));
      double* row = found.data_ptr<double>();
      for (int64_t j = 0; j < beam; ++j) {
        if (!finishing[j]) continue;
        row[0] = static_cast<double>(flight.key);
        row[1] = best[j];
        row[2] = static_cast<double>(best[j]) / penalty;
        const int64_t* past = flight.history.data() + origin[j] * length;
        for (int64_t t = 0; t < length; ++t) row[3 + t] = static_cast<double>(past[t]);
        row += 3 + length;
      }
      flight.found.push_back(found);
    }
    // the limit reached: search.py's loop ends there (beam_search's `longest`)
    over = over || flight.length + 1 >= flight.limit;
    if (over) return true;
    // Beams.advance: each new beam extends its parent by its token; the origins follow
    std::vector<float> scores(beam);
    std::vector<int64_t> tokens(beam), history;
    history.reserve(beam * (length + 1));
    for (int64_t j = 0; j < beam; ++j) {
      const int64_t candidate = chosen[j], parent = origin[candidate];
      scores[j] = best[candidate];
      tokens[j] = picked[candidate];
      const int64_t* past = flight.history.data() + parent * length;
      history.insert(history.end(), past, past + length);
      history.push_back(picked[candidate]);
      std::copy_n(flight.origin.data() + parent * flight.limit, length + 1,
                  flight.spare_origin.data() + j * flight.limit);
    }
    std::swap(flight.origin, flight.spare_origin);
    flight.scores = std::move(scores);
    flight.tokens = std::move(tokens);
    flight.history = std::move(history);
    flight.group = beam;
    flight.length += 1;
    return false;
  }

  const Decoder& decoder_;
  int64_t beam_, nbest_, stop_;
  double alpha_;
  int64_t eos_id_, bos_id_, eos_column_;
  Tensor banned_ids_, column_ids_;
  std::optional<Linear> output_;
  std::vector<char> banned_;
  std::vector<Flight> flights_;
};

std::vector<Tensor> Decoder::fused_beam_search(
    const SearchBatch& batch, const Tensor& positions,
    const std::optional<pybind11::function>& cancelled) const {
  // a Stream whose sentences all join at the first step, their memory the batch's (padded,
  // with its mask)
  const int64_t sentences = batch.limits.size(0);
  Stream stream(*this, batch.beam, batch.nbest, batch.stop, batch.alpha, batch.eos_id,
                batch.bos_id, batch.eos_column, batch.banned, batch.column_ids, batch.output);
  const Tensor limits = batch.limits.to(at::kLong).contiguous();
  for (int64_t b = 0; b < sentences; ++b) {
    std::vector<Tensor> memory;
    for (const Tensor& tensor : batch.memory_kv) memory.push_back(tensor[b]);
    stream.add(b, std::move(memory), batch.src_mask[b].reshape({-1}),
               limits.data_ptr<int64_t>()[b], {});
  }
  std::vector<std::vector<Tensor>> found(sentences);
  while (stream.sentences() > 0) {
    if (cancelled.has_value()) {  // search.CalledOff: asked before each step's read
      pybind11::gil_scoped_acquire gil;
      for (auto item : (*cancelled)()) stream.call_off(item.cast<int64_t>());
    }
    for (auto& [key, rows] : stream.step(positions)) found[key] = std::move(rows);
  }
  std::vector<Tensor> rows;
  for (auto& each : found)
    for (Tensor& part : each) rows.push_back(std::move(part));
  return rows;
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
             std::optional<py::function> cancelled, bool fused) {
            SearchBatch batch{std::move(src_mask), std::move(memory_kv), std::move(self_kv),
                              std::move(output), std::move(column_ids), std::move(limits),
                              std::move(limit_lengths), std::move(banned), std::move(penalties),
                              eos_column, eos_id, bos_id, beam, nbest, stop, alpha};
            py::gil_scoped_release released;
            return decoder.beam_search(batch, positions, cancelled, fused);
          },
          py::arg("src_mask"), py::arg("memory_kv"), py::arg("self_kv"), py::arg("output"),
          py::arg("column_ids"), py::arg("limits"), py::arg("limit_lengths"), py::arg("banned"),
          py::arg("penalties"), py::arg("eos_column"), py::arg("eos_id"), py::arg("bos_id"),
          py::arg("beam"), py::arg("nbest"), py::arg("stop"), py::arg("alpha"),
          py::arg("positions"), py::arg("cancelled"), py::arg("fused"))
      .def_property_readonly("fusable", &Decoder::fusable)
      .def(
          "fused_step",
          [](const Decoder& decoder, Tensor tokens, Tensor positions, PositionCache& cache) {
            return decoder.fused_step(tokens, positions.contiguous(), cache);
          },
          py::arg("tokens"), py::arg("positions"), py::arg("cache"),
          py::call_guard<py::gil_scoped_release>());
  py::class_<Stream>(module, "Stream")
      .def(py::init<const Decoder&, int64_t, int64_t, int64_t, double, int64_t, int64_t, int64_t,
                    Tensor, std::optional<Tensor>, std::optional<Linear>>(),
           py::arg("decoder"), py::arg("beam"), py::arg("nbest"), py::arg("stop"),
           py::arg("alpha"), py::arg("eos_id"), py::arg("bos_id"), py::arg("eos_column"),
           py::arg("banned"), py::arg("column_ids"), py::arg("output"),
           py::keep_alive<1, 2>())
      .def("add", &Stream::add, py::arg("key"), py::arg("memory"), py::arg("mask"),
           py::arg("limit"), py::arg("prefix") = std::vector<int64_t>())
      .def("call_off", &Stream::call_off, py::arg("key"))
      .def("sentences", &Stream::sentences)
      .def("rows", &Stream::rows)
      .def("step", &Stream::step, py::arg("positions"), py::call_guard<py::gil_scoped_release>());
  py::class_<PositionCache>(module, "PositionCache")
      .def(py::init<Tensor, std::vector<Tensor>, int64_t, int64_t, int64_t, int64_t, int64_t>(),
           py::arg("src_mask"), py::arg("memory_kv"), py::arg("layers"), py::arg("key_width"),
           py::arg("value_width"), py::arg("positions"), py::arg("rows"))
      .def(
          "reorder",
          [](PositionCache& cache, Tensor rows, std::optional<Tensor> sources) {
            cache.reorder(rows.to(at::kLong).contiguous(), sources);
          },
          py::arg("rows"), py::arg("sources") = std::nullopt)
      .def_readwrite("length", &PositionCache::length)
      .def_readonly("capacity", &PositionCache::capacity);
}
