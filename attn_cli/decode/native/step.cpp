// attn's decoder step in C++ (issue 53, stage A): `model.Transformer.decode_step` for a model
// made for decoding on a CPU (devices.inference_model: oneDNN's packed linear layers, or
// torch's dense ones), as one call that holds no Python and releases the GIL once.
//
// Every op below is the ATen op the eager step dispatches, with the same arguments, in the same
// order, so the logits are the eager step's bit for bit (tests/decode/test_native.py holds
// them equal): embedding, scale and position; per layer the packed QKV projection, the cache
// grown in one copy into a spare buffer (model.grow_cache), the one-query attention written out
// as two batched matmuls with the softmax in float32 (model.attention_written_out), the
// encoder-decoder attention of the G beams of a source together (attend_memory), residual and
// LayerNorm after each sub-layer (or before it, pre-norm), the feed-forward block, and the
// output projection. What the eager step pays and this one does not: ~170 Python calls a step
// (a 3-layer decoder), each parsing its arguments and taking the GIL back.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <optional>
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

// A linear layer as the model holds it: packed (devices.PackedLinear, its activation fused) or
// dense (nn.Linear, the activation, if any, applied after it as FeedForward does).
struct Linear {
  bool packed = false;
  Tensor weight;
  std::optional<Tensor> bias;
  std::string activation = "none";

  Tensor operator()(const Tensor& x) const {
    if (packed) return packed_linear(x, weight, bias, activation);
    Tensor y = at::linear(x, weight, bias);
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
    const size_t count = layers_.size();
    TORCH_CHECK(memory_kv.size() == 2 * count && self_kv.size() == 2 * count &&
                    (spare.empty() || spare.size() == 2 * count),
                "a step takes two cache tensors per decoder layer");
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
      if (!spare.empty()) {
        spare_k = spare[2 * i];
        spare_v = spare[2 * i + 1];
      }
      auto [keys, key_buffer] = grow_cache(self_kv[2 * i], k, self_rows, spare_k);
      auto [values, value_buffer] = grow_cache(self_kv[2 * i + 1], v, self_rows, spare_v);
      Tensor context = attention_written_out(q, keys.transpose(-1, -2), values, nullptr);
      x = after(layer, 0, x, layer.self_out(context.transpose(1, 2).reshape({rows, 1, -1})));
      // encoder-decoder attention: the G = N / B beams of a source query it together
      h = pre_norm_ ? layer.norms[1](x) : x;
      const Tensor& memory_keys_t = memory_kv[2 * i];
      Tensor queries = layer.cross_q(h).view({memory_keys_t.size(0), -1, heads_, d_k_})
                           .transpose(1, 2);
      context = attention_written_out(queries, memory_keys_t, memory_kv[2 * i + 1], &src_mask);
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
    Tensor hidden = x.select(1, 0);
    return {project ? output_(hidden) : hidden, std::move(grown), std::move(buffers)};
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  namespace py = pybind11;
  py::class_<Linear>(module, "Linear")
      .def(py::init([](bool packed, Tensor weight, std::optional<Tensor> bias,
                       std::string activation) {
             return Linear{packed, std::move(weight), std::move(bias), std::move(activation)};
           }),
           py::arg("packed"), py::arg("weight"), py::arg("bias"), py::arg("activation"))
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
      .def("step", &Decoder::step, py::call_guard<py::gil_scoped_release>());
}
