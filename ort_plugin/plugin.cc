// onnx2fused ORT plugin: registers one custom op per generated kernel (domain "onnx2fused").
// Hand-written; compiled into every plugin library together with the generated sources.
//
// For each KernelEntry of the generated table:
//   - a CPU-EP op, always: the generated C++ kernel when the entry has one, else the node's stock body
//     (its `stock_model` attribute) run in an inner ONNX Runtime session. A CPU op is needed for every
//     op type: once a library registers any kernel for an op type, ORT gives the node that op's schema
//     and no longer inlines the model-local function, so a CPU-EP node without a CPU kernel fails to
//     load ("Could not find an implementation"; docs/DESIGN.md, "The CPU path").
//   - a CUDA-EP op when the library is built with -DONNX2FUSED_WITH_CUDA.
// Inputs: X [..., K0] (float32 or float16), then W_i [K_i, N_i] and B_i [N_i] (float32) per layer
// ([K_i, 2 N_i] and [2 N_i] for a gated layer: KernelEntry::weight_cols), then a transformer block's norm
// parameters (KernelEntry::norm_inputs): NS [K0] (scale), and NB [K0] (bias) for a layer norm, float32.
// Output: Y [..., N_last], the element type of X; a pooled entry (KernelEntry::pool) writes the max, sum or
// mean (KernelEntry::pool_op) over X's axis -2, Y [..., N_last] (or [..., 1, N_last]). Bad inputs give an ORT error naming the expected shape.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fused_mlp_registry.h"

#ifdef ONNX2FUSED_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace onnx2fused {
namespace {

const char* const kDomain = "onnx2fused";

OrtStatusPtr Error(OrtErrorCode code, const std::string& msg) {
  return Ort::GetApi().CreateStatus(code, msg.c_str());
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

std::string WidthsText(const KernelEntry& e) {
  return ShapeText(std::vector<int64_t>(e.widths, e.widths + e.num_layers + 1));
}

const char* TypeName(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "float64";
    default: return "a non-float type";
  }
}

// Columns of layer i's weight W_i (and length of its bias B_i): 2 N_i for a gated layer.
int64_t WeightCols(const KernelEntry& e, int i) { return e.weight_cols ? e.weight_cols[i] : e.widths[i + 1]; }

ONNXTensorElementDataType IoType(const KernelEntry& e) {
  return e.io_is_half ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t InputCount(const KernelEntry& e) { return static_cast<size_t>(1 + 2 * e.num_layers + e.norm_inputs); }

const char* const kNormInputs[2] = {"NS", "NB"};  // the norm's scale and bias (layer norm), after the layers'

// The checked inputs and the allocated output of one Compute call. With a norm in front, w and b hold
// one more entry: its scale NS and its bias NB (nullptr without one), as the CPU kernel takes them.
struct Call {
  const void* x = nullptr;
  void* y = nullptr;
  int64_t rows = 0;
  int64_t groups = 0;   // a pooled entry (KernelEntry::pool): Y's rows, each the pool of rows / groups of X's
  std::vector<const float*> w, b;
};

// Checks every input against the entry, allocates the output. Returns an error status or nullptr.
OrtStatusPtr Prepare(const KernelEntry& e, Ort::KernelContext& ctx, Call& call) {
  const int L = e.num_layers;
  const std::string op = std::string(kDomain) + "." + e.name;
  if (ctx.GetInputCount() != InputCount(e)) {
    std::ostringstream s;
    s << op << ": expected " << InputCount(e) << " inputs (X, then W_i, B_i for " << L << " layers"
      << (e.norm_inputs == 2 ? ", then NS, NB" : e.norm_inputs == 1 ? ", then NS" : "") << "), got "
      << ctx.GetInputCount();
    return Error(ORT_INVALID_ARGUMENT, s.str());
  }
  Ort::ConstValue X = ctx.GetInput(0);
  auto xinfo = X.GetTensorTypeAndShapeInfo();
  std::vector<int64_t> xshape = xinfo.GetShape();
  const int64_t K0 = e.widths[0], NL = e.widths[L];
  if (xshape.size() < 2 || xshape.back() != K0) {
    std::ostringstream s;
    s << op << ": input X must have shape [..., " << K0 << "] (rank >= 2, last dimension " << K0 << "), got "
      << ShapeText(xshape);
    return Error(ORT_INVALID_ARGUMENT, s.str());
  }
  if (xinfo.GetElementType() != IoType(e)) {
    std::ostringstream s;
    s << op << ": input X must be " << TypeName(IoType(e)) << ", got " << TypeName(xinfo.GetElementType());
    return Error(ORT_INVALID_ARGUMENT, s.str());
  }
  call.w.resize(L);
  call.b.resize(L);
  for (int i = 0; i < L; ++i) {
    const int64_t K = e.widths[i] + ((e.skip_mask >> i) & 1u ? e.skip_width : 0), N = WeightCols(e, i);  // N: W_i's columns
    Ort::ConstValue W = ctx.GetInput(1 + 2 * i), B = ctx.GetInput(2 + 2 * i);
    auto winfo = W.GetTensorTypeAndShapeInfo();
    auto binfo = B.GetTensorTypeAndShapeInfo();
    std::vector<int64_t> ws = winfo.GetShape(), bs = binfo.GetShape();
    if (winfo.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || ws != std::vector<int64_t>{K, N}) {
      std::ostringstream s;
      s << op << ": weight W_" << i << " must be float32 [" << K << ", " << N << "], got "
        << TypeName(winfo.GetElementType()) << " " << ShapeText(ws);
      return Error(ORT_INVALID_ARGUMENT, s.str());
    }
    if (binfo.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || bs != std::vector<int64_t>{N}) {
      std::ostringstream s;
      s << op << ": bias B_" << i << " must be float32 [" << N << "], got " << TypeName(binfo.GetElementType())
        << " " << ShapeText(bs);
      return Error(ORT_INVALID_ARGUMENT, s.str());
    }
    call.w[i] = W.GetTensorData<float>();
    call.b[i] = B.GetTensorData<float>();
  }
  if (e.norm_inputs > 0) {
    const float* norm[2] = {nullptr, nullptr};
    for (int j = 0; j < e.norm_inputs; ++j) {
      Ort::ConstValue P = ctx.GetInput(1 + 2 * L + j);
      auto pinfo = P.GetTensorTypeAndShapeInfo();
      std::vector<int64_t> ps = pinfo.GetShape();
      if (pinfo.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || ps != std::vector<int64_t>{K0}) {
        std::ostringstream s;
        s << op << ": norm input " << kNormInputs[j] << " must be float32 [" << K0 << "], got "
          << TypeName(pinfo.GetElementType()) << " " << ShapeText(ps);
        return Error(ORT_INVALID_ARGUMENT, s.str());
      }
      norm[j] = P.GetTensorData<float>();
    }
    call.w.push_back(norm[0]);
    call.b.push_back(norm[1]);
  }
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < xshape.size(); ++d) rows *= xshape[d];
  std::vector<int64_t> yshape = xshape;
  yshape.back() = NL;
  if (e.pool) {   // Y [..., N_last]: the pool over X's axis -2
    if (xshape.size() < 3) {
      std::ostringstream s;
      s << op << ": input X must have shape [..., rows, " << K0 << "] (rank >= 3: the op pools over axis -2), got "
        << ShapeText(xshape);
      return Error(ORT_INVALID_ARGUMENT, s.str());
    }
    if (e.pool == 2) yshape[yshape.size() - 2] = 1;   // keepdims
    else yshape.erase(yshape.end() - 2);
    call.groups = 1;
    for (size_t d = 0; d + 2 < xshape.size(); ++d) call.groups *= xshape[d];
  }
  Ort::UnownedValue Y = ctx.GetOutput(0, yshape);
  call.rows = rows;
  if (rows > 0) call.x = X.GetTensorRawData();
  if (rows > 0 || (e.pool && call.groups > 0)) call.y = Y.GetTensorMutableRawData();
  return nullptr;
}

// A pooled entry on the CPU: the chain's rows go to a buffer of their own (RowsForPool), then each group's
// pool to Y (PoolRows).
struct RowsForPool {
  void* pooled = nullptr;
  std::unique_ptr<char[]> rows;   // not zeroed: the kernel writes every row before PoolRows reads it
  RowsForPool(const KernelEntry& e, Call& call) {
    if (!e.pool) return;
    pooled = call.y;
    const size_t bytes = static_cast<size_t>(call.rows * e.widths[e.num_layers]) * (e.io_is_half ? 2 : 4);
    rows.reset(new char[bytes ? bytes : 1]);
    call.y = rows.get();
  }
};

inline bool HalfIsNan(uint16_t h) { return (h & 0x7fff) > 0x7c00; }
inline uint16_t HalfOrder(uint16_t h) { return (h & 0x8000) ? static_cast<uint16_t>(~h) : static_cast<uint16_t>(h | 0x8000); }
inline float MaxNan(float o, float v) { return (v > o || (v != v && o == o)) ? v : o; }
// -inf in the element type as the CPU paths hold it (fp16 as its bits): where every max pool starts.
template <class T> constexpr T kLowest = T{};
template <> constexpr float kLowest<float> = -std::numeric_limits<float>::infinity();
template <> constexpr uint16_t kLowest<uint16_t> = 0xfc00;
inline uint16_t MaxNan(uint16_t o, uint16_t v) {
  return (!HalfIsNan(o) && (HalfIsNan(v) || HalfOrder(v) > HalfOrder(o))) ? v : o;
}
inline float Widen(float v) { return v; }
inline float Widen(uint16_t h) { return Ort::Float16_t::FromBits(h).ToFloat(); }
template <class T> T Narrow(float v);
template <> inline float Narrow<float>(float v) { return v; }
template <> inline uint16_t Narrow<uint16_t>(float v) { return Ort::Float16_t(v).val; }   // (nearest even)

// The pools (KernelEntry::pool_op) over rows of element type T, through partial results of type Acc:
// the max in T itself (exact: rounding is monotonic), NaN winning as in ONNX Runtime's CUDA ReduceMax, -inf
// over no rows; the sum and the mean in float (fp16 rows widened), 0 over no rows, the mean's 1/rows
// applied once at the end (Finish's scale) as ReduceMean divides its sum.
template <class T>
struct MaxPool {
  using Elem = T;
  using Acc = T;
  static Acc Start() { return kLowest<T>; }
  static Acc Add(Acc a, T v) { return MaxNan(a, v); }
  static Acc Merge(Acc a, Acc b) { return MaxNan(a, b); }
  static T Finish(Acc a, float) { return a; }
};
template <class T>
struct SumPool {
  using Elem = T;
  using Acc = float;
  static Acc Start() { return 0.0f; }
  static Acc Add(Acc a, T v) { return a + Widen(v); }
  static Acc Merge(Acc a, Acc b) { return a + b; }
  static T Finish(Acc a, float scale) { return Narrow<T>(a * scale); }
};

// f(P{}) with P the pool policy of entry e over its I/O type as the CPU paths hold it (fp16 as its bits,
// float): the one place the pooling code turns e.io_is_half and e.pool_op into types.
template <class F>
void WithPool(const KernelEntry& e, F&& f) {
  const bool sum = e.pool_op != 0;
  if (e.io_is_half) sum ? f(SumPool<uint16_t>{}) : f(MaxPool<uint16_t>{});
  else sum ? f(SumPool<float>{}) : f(MaxPool<float>{});
}

// What the pool's result is multiplied by: 1 / rows a group for a mean (of some rows), else 1.
inline float PoolScale(const KernelEntry& e, int64_t per_group) {
  return e.pool_op == 2 && per_group > 0 ? 1.0f / static_cast<float>(per_group) : 1.0f;
}

// acc[0, c1 - c0) = P's partial pool of columns [c0, c1) over `rows` rows of `in` (n columns each), row by
// row (a row's columns are contiguous).
template <class P, class T>
void PoolColumns(const T* in, typename P::Acc* acc, int64_t rows, int64_t n, int64_t c0, int64_t c1) {
  std::fill(acc, acc + (c1 - c0), P::Start());
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = in + r * n;
    for (int64_t c = c0; c < c1; ++c) acc[c - c0] = P::Add(acc[c - c0], row[c]);
  }
}

// Columns [c0, c1) (at most kPoolCols) of group g: the pool over the group's `per` rows, into Y.
constexpr int64_t kPoolCols = 256;
template <class P, class T>
void PoolBlock(const T* in, T* out, int64_t per, int64_t n, int64_t g, int64_t c0, int64_t c1, float scale) {
  typename P::Acc acc[kPoolCols];
  PoolColumns<P>(in + g * per * n, acc, per, n, c0, c1);
  for (int64_t c = c0; c < c1; ++c) out[g * n + c] = P::Finish(acc[c - c0], scale);
}

// One task a group and block of kPoolCols columns, over the session's threads.
struct PoolTask {
  const KernelEntry* e;
  const Call* call;
  void* pooled;
  int64_t blocks;
};

void RunPoolTask(void* data, size_t task) {
  const PoolTask& t = *static_cast<const PoolTask*>(data);
  const int64_t n = t.e->widths[t.e->num_layers], per = t.call->groups ? t.call->rows / t.call->groups : 0;
  const int64_t g = static_cast<int64_t>(task) / t.blocks, c0 = (static_cast<int64_t>(task) % t.blocks) * kPoolCols;
  const int64_t c1 = std::min(n, c0 + kPoolCols);
  WithPool(*t.e, [&](auto pool) {
    using P = decltype(pool);
    using T = typename P::Elem;
    PoolBlock<P>(static_cast<const T*>(t.call->y), static_cast<T*>(t.pooled), per, n, g, c0, c1, PoolScale(*t.e, per));
  });
}

void PoolRows(const KernelEntry& e, const Call& call, void* pooled, Ort::KernelContext& ctx) {
  const int64_t n = e.widths[e.num_layers];
  PoolTask task{&e, &call, pooled, (n + kPoolCols - 1) / kPoolCols};
  const int64_t tasks = call.groups * task.blocks;
  if (tasks <= 1 || call.rows * n < (int64_t{1} << 16)) {   // (small: a thread's work is less than a task's)
    for (int64_t k = 0; k < tasks; ++k) RunPoolTask(&task, static_cast<size_t>(k));
  } else {
    ctx.ParallelFor(&RunPoolTask, static_cast<size_t>(tasks), 0, &task);
  }
}

template <class F>
OrtStatusPtr Guard(F&& f) {
  try {
    return f();
  } catch (const Ort::Exception& ex) {
    return Error(ex.GetOrtErrorCode(), ex.what());
  } catch (const std::exception& ex) {
    return Error(ORT_FAIL, ex.what());
  }
}

// ---------------------------------------------------------------------------------------------- CPU
struct CpuTask {
  const KernelEntry* e;
  Call* call;
  int64_t rows_per_task;
  size_t in_row_bytes, out_row_bytes;
};

void RunCpuTask(void* data, size_t task) {
  const CpuTask& t = *static_cast<const CpuTask*>(data);
  const int64_t r0 = static_cast<int64_t>(task) * t.rows_per_task;
  int64_t n = t.call->rows - r0;
  if (n > t.rows_per_task) n = t.rows_per_task;
  if (n <= 0) return;
  t.e->cpu(static_cast<const char*>(t.call->x) + r0 * t.in_row_bytes,
           static_cast<char*>(t.call->y) + r0 * t.out_row_bytes, n, t.call->w.data(), t.call->b.data(), 1);
}

// A pooled entry's generated kernel: tasks of rows within one group, each run through the kernel into a
// buffer of the thread's own (one task's rows: they stay in cache) and pooled there into the task's partial
// result; the partials then go into Y group by group. The rows never make a round trip through memory.
struct PooledTask {
  const KernelEntry* e;
  const Call* call;
  int64_t per_group, tasks_per_group, rows_per_task;
  char* partials;   // tasks x N_last, the pool's partial type (P::Acc)
};

void RunPooledTask(void* data, size_t task) {
  const PooledTask& t = *static_cast<const PooledTask*>(data);
  const KernelEntry& e = *t.e;
  const int64_t n = e.widths[e.num_layers], elem = e.io_is_half ? 2 : 4;
  const int64_t g = static_cast<int64_t>(task) / t.tasks_per_group, k = static_cast<int64_t>(task) % t.tasks_per_group;
  const int64_t r0 = g * t.per_group + k * t.rows_per_task;
  const int64_t rows = std::min(t.rows_per_task, t.per_group - k * t.rows_per_task);
  thread_local std::vector<char> buf;
  if (rows > 0) {
    if (buf.size() < static_cast<size_t>(rows * n * elem)) buf.resize(static_cast<size_t>(rows * n * elem));
    e.cpu(static_cast<const char*>(t.call->x) + r0 * e.widths[0] * elem, buf.data(), rows, t.call->w.data(),
          t.call->b.data(), 1);
  }
  const int64_t pooled_rows = std::max<int64_t>(rows, 0);
  WithPool(e, [&](auto pool) {
    using P = decltype(pool);
    using T = typename P::Elem;
    auto* partial = reinterpret_cast<typename P::Acc*>(t.partials) + static_cast<int64_t>(task) * n;
    PoolColumns<P>(reinterpret_cast<const T*>(buf.data()), partial, pooled_rows, n, 0, n);
  });
}

template <class P, class T>
void CombinePartials(const typename P::Acc* partials, T* y, int64_t groups, int64_t tasks_per_group, int64_t n,
                     float scale) {
  for (int64_t g = 0; g < groups; ++g) {
    const typename P::Acc* p = partials + g * tasks_per_group * n;
    for (int64_t c = 0; c < n; ++c) {
      typename P::Acc a = p[c];
      for (int64_t k = 1; k < tasks_per_group; ++k) a = P::Merge(a, p[k * n + c]);
      y[g * n + c] = P::Finish(a, scale);
    }
  }
}

struct CpuKernel {
  const KernelEntry* e;
  explicit CpuKernel(const KernelEntry* entry) : e(entry) {}

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return Guard([&]() -> OrtStatusPtr {
      Ort::KernelContext ctx(context);
      Call call;
      if (OrtStatusPtr st = Prepare(*e, ctx, call)) return st;
      if (e->pool) {
        RunPooled(call, ctx);
      } else if (call.rows > 0) {
        Run(call, ctx);
      }
      return nullptr;
    });
  }

  void RunPooled(Call& call, Ort::KernelContext& ctx) {
    const int64_t n = e->widths[e->num_layers];
    const int64_t per = call.groups ? call.rows / call.groups : 0;
    const int64_t rpt = e->rows_per_task > 0 ? e->rows_per_task : 64;
    PooledTask task{e, &call, per, std::max<int64_t>(1, (per + rpt - 1) / rpt), rpt, nullptr};
    const int64_t tasks = call.groups * task.tasks_per_group;
    if (tasks <= 0) return;
    std::unique_ptr<float[]> partials(new float[static_cast<size_t>(tasks * n)]);   // (4 bytes: any P::Acc)
    task.partials = reinterpret_cast<char*>(partials.get());
    if (tasks == 1) RunPooledTask(&task, 0);
    else ctx.ParallelFor(&RunPooledTask, static_cast<size_t>(tasks), 0, &task);
    WithPool(*e, [&](auto pool) {
      using P = decltype(pool);
      using T = typename P::Elem;
      CombinePartials<P>(reinterpret_cast<const typename P::Acc*>(task.partials), static_cast<T*>(call.y),
                         call.groups, task.tasks_per_group, n, PoolScale(*e, per));
    });
  }

  void Run(Call& call, Ort::KernelContext& ctx) {
    const size_t elem = e->io_is_half ? 2 : 4;
    CpuTask task{e, &call, e->rows_per_task > 0 ? e->rows_per_task : 64,
                 elem * static_cast<size_t>(e->widths[0]), elem * static_cast<size_t>(e->widths[e->num_layers])};
    const int64_t tasks = (call.rows + task.rows_per_task - 1) / task.rows_per_task;
    if (tasks <= 1) {
      RunCpuTask(&task, 0);
    } else {
      ctx.ParallelFor(&RunCpuTask, static_cast<size_t>(tasks), 0, &task);
    }
  }
};

// ----------------------------------------------------------------------------------- CPU, stock ops
// The chain's stock body (MatMul, Add, the activation ops) as ONNX Runtime itself runs it, for chains
// whose generated C++ kernel the cost model declines (cpu_policy.py: MLAS is faster there). The body
// comes from the node's `stock_model` attribute: a serialized model, base64 (a string attribute passes
// through C strings, and raw protobuf bytes may hold NULs). Its weights, biases and norm parameters are
// initializers with external data that the kernel fills at creation from the node's constant inputs
// (AddExternalInitializers copies them in before the inner session optimises): so ORT prepacks the
// weights for MLAS and fuses the body (BiasGelu, FusedMatMul) as it does in the original model; fed as
// inputs on every run, they were repacked each call and made the fallback ~30% slower than stock on a
// ViT. The inner session has one thread; the rows are split into tasks over the outer session's thread
// pool (ctx.ParallelFor), so the user's thread settings hold and no second pool competes for the cores.
const char* const kStockModelAttr = "stock_model";

std::string Base64Decode(const std::string& in) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  out.reserve(in.size() / 4 * 3);
  int bits = 0, acc = 0;
  for (char c : in) {
    if (c == '=') break;
    const int v = value(c);
    if (v < 0) throw std::runtime_error("the node's stock_model attribute is not base64");
    acc = (acc << 6) | v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  return out;
}

Ort::Env& InnerEnv() {
  // ORT keeps one environment per process: this returns the host's (reference counted). Leaked on
  // purpose, like the registry: sessions may outlive static destruction.
  static Ort::Env* env = new Ort::Env(ORT_LOGGING_LEVEL_ERROR, "onnx2fused");
  return *env;
}

struct StockCpuKernel;

struct StockTask {
  StockCpuKernel* k;
  Call* call;
  int64_t rows_per_task;
  OrtStatusPtr* errors;  // one slot per task: ParallelFor gives no way to return a status
};

void RunStockTask(void* data, size_t task);

struct StockCpuKernel {
  static constexpr int64_t kMinRowsPerTask = 32;  // an inner Run costs ~10 us: a task of 32 rows of a ViT FFN is ~100 us
  static constexpr int64_t kMaxTasks = 64;
  const KernelEntry* e;
  Ort::Session session{nullptr};
  const char* input_name = "X";   // the rows: the body's only input (its parameters are initializers)
  const char* output_name = "Y";
  Ort::MemoryInfo cpu = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);

  StockCpuKernel(const KernelEntry* entry, const OrtKernelInfo* info) : e(entry) {
    Ort::ConstKernelInfo ki(info);
    std::string encoded;
    try {
      encoded = ki.GetAttribute<std::string>(kStockModelAttr);
    } catch (const Ort::Exception&) {
      throw std::runtime_error(std::string(kDomain) + "." + e->name +
                               ": the node has no stock_model attribute, which this library's CPU path "
                               "needs; the model was converted by an older onnx2fused (re-run onnx2fused convert)");
    }
    const std::string model = Base64Decode(encoded);
    Ort::SessionOptions so;
    so.SetIntraOpNumThreads(1);
    so.SetInterOpNumThreads(1);
    so.SetExecutionMode(ORT_SEQUENTIAL);
    so.SetLogSeverityLevel(3);
    // The node's inputs after X (W_i, B_i, then NS, NB) are the outer model's initializers: the inner
    // model's initializers of the same names, whose data comes from here (copied in at load).
    std::vector<std::string> names;
    std::vector<Ort::Value> values;
    for (size_t k = 1; k < InputCount(*e); ++k) {
      int is_constant = 0;
      Ort::ConstValue v = ki.GetTensorConstantInput(k, &is_constant);
      if (!is_constant)
        throw std::runtime_error(std::string(kDomain) + "." + e->name + ": input " + std::to_string(k) +
                                 " is not a constant initializer; the CPU path needs the weights constant");
      const int layer = static_cast<int>((k - 1) / 2);
      names.push_back(layer < e->num_layers ? ((k - 1) % 2 ? "B" : "W") + std::to_string(layer)
                                            : std::string(kNormInputs[k - 1 - 2 * e->num_layers]));
      auto info = v.GetTensorTypeAndShapeInfo();
      std::vector<int64_t> shape = info.GetShape();
      values.push_back(Ort::Value::CreateTensor<float>(cpu, const_cast<float*>(v.GetTensorData<float>()),
                                                       info.GetElementCount(), shape.data(), shape.size()));
    }
    so.AddExternalInitializers(names, values);
    session = Ort::Session(InnerEnv(), model.data(), model.size(), so);
  }

  // Rows [r0, r0 + n) of the call through the inner session, writing straight into Y.
  void RunRows(const Call& call, int64_t r0, int64_t n) {
    const int L = e->num_layers;
    const size_t elem = e->io_is_half ? 2 : 4;
    const ONNXTensorElementDataType io = IoType(*e);
    const int64_t K0 = e->widths[0], NL = e->widths[L];
    int64_t xshape[2] = {n, K0}, yshape[2] = {n, NL};
    char* x = const_cast<char*>(static_cast<const char*>(call.x)) + r0 * K0 * elem;
    Ort::Value in = Ort::Value::CreateTensor(cpu, x, n * K0 * elem, xshape, 2, io);
    char* y = static_cast<char*>(call.y) + r0 * NL * elem;
    Ort::Value out = Ort::Value::CreateTensor(cpu, y, n * NL * elem, yshape, 2, io);
    session.Run(Ort::RunOptions{nullptr}, &input_name, &in, 1, &output_name, &out, 1);
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return Guard([&]() -> OrtStatusPtr {
      Ort::KernelContext ctx(context);
      Call call;
      if (OrtStatusPtr st = Prepare(*e, ctx, call)) return st;
      RowsForPool pool(*e, call);
      OrtStatusPtr st = call.rows > 0 ? RunAll(call, ctx) : nullptr;
      if (!st && e->pool) PoolRows(*e, call, pool.pooled, ctx);
      return st;
    });
  }

  OrtStatusPtr RunAll(Call& call, Ort::KernelContext& ctx) {
    // Equal tasks (300 rows on 2 threads: 150 + 150, not 256 + 44), each of at least kMinRowsPerTask
    // rows, at most kMaxTasks of them and no more than the host has hardware threads (ORT's default
    // pool size is its cores): each task is an inner Run of ~10 us, and a ViT image's 197 rows in 6
    // tasks on a 2-core host cost 4 Runs more per node than in 2 (RESULTS.md, "lone linear layers on
    // the CPU run their stock body").
    static const int64_t hw = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()));
    const int64_t tasks = std::min<int64_t>(std::min<int64_t>(kMaxTasks, hw),
                                            std::max<int64_t>(1, call.rows / kMinRowsPerTask));
    const int64_t per = (call.rows + tasks - 1) / tasks;
    if (tasks <= 1) {
      RunRows(call, 0, call.rows);
      return nullptr;
    }
    std::vector<OrtStatusPtr> errors(static_cast<size_t>(tasks), nullptr);
    StockTask task{this, &call, per, errors.data()};
    ctx.ParallelFor(&RunStockTask, static_cast<size_t>(tasks), 0, &task);
    OrtStatusPtr first = nullptr;
    for (OrtStatusPtr st : errors) {
      if (st && !first) first = st;
      else if (st) Ort::GetApi().ReleaseStatus(st);
    }
    return first;
  }
};

void RunStockTask(void* data, size_t task) {
  StockTask& t = *static_cast<StockTask*>(data);
  const int64_t r0 = static_cast<int64_t>(task) * t.rows_per_task;
  int64_t n = t.call->rows - r0;
  if (n > t.rows_per_task) n = t.rows_per_task;
  if (n <= 0) return;
  t.errors[task] = Guard([&]() -> OrtStatusPtr {
    t.k->RunRows(*t.call, r0, n);
    return nullptr;
  });
}

// --------------------------------------------------------------------------------------------- CUDA
#ifdef ONNX2FUSED_WITH_CUDA
OrtStatusPtr CudaError(const KernelEntry& e, const char* what, int rc) {
  std::ostringstream s;
  s << kDomain << "." << e.name << ": " << what << " failed: " << cudaGetErrorString(static_cast<cudaError_t>(rc))
    << " (" << rc << ")";
  return Error(ORT_EP_FAIL, s.str());
}

// A pooled entry with float16 I/O raises float entries (o2f_pool.cuh: one fire-and-forget atomic each) in
// a device buffer from ONNX Runtime's allocator for the device, rounded into Y at the end of the run. It is
// given back as soon as the run is queued, as ORT's own kernels do with their scratch: later users of the
// memory are queued behind the run on the same stream.
class PoolScratch {
 public:
  ~PoolScratch() {
    if (p_) alloc_->Free(alloc_, p_);
    if (alloc_) Ort::GetApi().ReleaseAllocator(alloc_);
  }
  OrtStatusPtr Get(const KernelEntry& e, const Call& call, OrtKernelContext* context, int dev, void** out) {
    *out = nullptr;
    if (!e.pool || !e.io_is_half || call.groups <= 0) return nullptr;
    const size_t bytes = static_cast<size_t>(call.groups) * static_cast<size_t>(e.widths[e.num_layers]) * sizeof(float);
    Ort::MemoryInfo device("Cuda", OrtDeviceAllocator, dev, OrtMemTypeDefault);
    if (OrtStatusPtr st = Ort::GetApi().KernelContext_GetAllocator(context, device, &alloc_)) return st;
    p_ = alloc_->Alloc(alloc_, bytes);
    if (!p_) {
      std::ostringstream s;
      s << kDomain << "." << e.name << ": could not allocate the pool's " << bytes << "-byte scratch on the device";
      return Error(ORT_EP_FAIL, s.str());
    }
    *out = p_;
    return nullptr;
  }

 private:
  OrtAllocator* alloc_ = nullptr;
  void* p_ = nullptr;
};

// ORT may call one kernel instance from several Run() calls at once, each on its own stream; the mutex
// below serialises the launches, not the GPU work. Kernels that only read the packed weights may overlap
// on the GPU; those that also write scratch in the workspace (KernelEntry::cuda_uses_scratch: the wide
// design) may not, so each of their runs records `last_run`, and a run on another stream first waits for
// it. Runs on one stream are ordered by the stream itself and never wait.
struct CudaKernel {
  // Packed weights per device: allocated once, packed again only when the weight pointers change.
  struct DeviceState {
    void* workspace = nullptr;
    std::vector<const float*> w, b;  // device pointers the workspace was packed from
    cudaStream_t packed_on = nullptr;
    cudaEvent_t packed = nullptr;    // recorded after packing, for runs on other streams
    cudaEvent_t last_run = nullptr;      // scratch users: recorded after the latest uncaptured run,
    cudaStream_t last_stream = nullptr;  // which was on this stream
    bool ran = false;                    // whether last_run was ever recorded
  };
  const KernelEntry* e;
  std::mutex mu;
  std::map<int, DeviceState> devices;

  explicit CudaKernel(const KernelEntry* entry) : e(entry) {}
  ~CudaKernel() {
    int current = 0;
    cudaGetDevice(&current);
    for (auto& kv : devices) {
      cudaSetDevice(kv.first);
      if (kv.second.packed) cudaEventDestroy(kv.second.packed);
      if (kv.second.last_run) cudaEventDestroy(kv.second.last_run);
      if (kv.second.workspace) cudaFree(kv.second.workspace);
    }
    cudaSetDevice(current);
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return Guard([&]() -> OrtStatusPtr {
      Ort::KernelContext ctx(context);
      Call call;
      if (OrtStatusPtr st = Prepare(*e, ctx, call)) return st;
      if (call.rows == 0 && !(e->pool && call.groups > 0)) return nullptr;   // (a pool of no rows: -inf)
      cudaStream_t stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
      int dev = 0;
      int rc = cudaGetDevice(&dev);
      if (rc) return CudaError(*e, "cudaGetDevice", rc);
      std::lock_guard<std::mutex> lock(mu);
      DeviceState& s = devices[dev];
      if (!s.workspace) {
        size_t bytes = e->cuda_workspace_bytes();
        rc = cudaMalloc(&s.workspace, bytes ? bytes : 1);
        if (rc) {
          s.workspace = nullptr;
          return CudaError(*e, "cudaMalloc of the packed-weight workspace", rc);
        }
        rc = cudaEventCreateWithFlags(&s.packed, cudaEventDisableTiming);
        if (rc) return CudaError(*e, "cudaEventCreate", rc);
      }
      // Scratch users: under stream capture (ORT's CUDA graphs) nothing runs now, and an event recorded
      // in a capture cannot be waited on outside it, so captured runs neither wait nor record.
      bool record = false;
      if (e->cuda_uses_scratch) {
        if (!s.last_run) {
          rc = cudaEventCreateWithFlags(&s.last_run, cudaEventDisableTiming);
          if (rc) {
            s.last_run = nullptr;
            return CudaError(*e, "cudaEventCreate", rc);
          }
        }
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        rc = cudaStreamIsCapturing(stream, &capture);
        if (rc) return CudaError(*e, "cudaStreamIsCapturing", rc);
        record = capture == cudaStreamCaptureStatusNone;
      }
      if (record && s.ran && stream != s.last_stream) {
        // The previous run, on another stream, may still be using the scratch (or the weights that
        // packing below would overwrite): queue behind it.
        rc = cudaStreamWaitEvent(stream, s.last_run, 0);
        if (rc) return CudaError(*e, "cudaStreamWaitEvent on the previous run", rc);
      }
      if (s.w != call.w || s.b != call.b) {
        rc = e->cuda_pack(call.w.data(), call.b.data(), s.workspace, stream);
        if (rc) return CudaError(*e, "packing the weights", rc);
        rc = cudaEventRecord(s.packed, stream);
        if (rc) return CudaError(*e, "cudaEventRecord", rc);
        s.w = call.w;
        s.b = call.b;
        s.packed_on = stream;
      } else if (stream != s.packed_on) {
        rc = cudaStreamWaitEvent(stream, s.packed, 0);
        if (rc) return CudaError(*e, "cudaStreamWaitEvent", rc);
      }
      PoolScratch pool;
      void* scratch = nullptr;
      if (OrtStatusPtr st = pool.Get(*e, call, context, dev, &scratch)) return st;
      rc = e->pool ? e->cuda_run_pool(call.x, call.y, call.rows, call.groups, s.workspace, scratch, stream)
                   : e->cuda_run(call.x, call.y, call.rows, s.workspace, stream);
      if (rc) return CudaError(*e, "the kernel launch", rc);
      if (record) {
        rc = cudaEventRecord(s.last_run, stream);
        if (rc) return CudaError(*e, "cudaEventRecord after the run", rc);
        s.last_stream = stream;
        s.ran = true;
      }
      return nullptr;
    });
  }
};
#endif

// ----------------------------------------------------------------------------------------------- op
// Checks the node's `widths` attribute against the entry. (The `activations` attribute is a list of
// strings, which the 1.21 C API cannot read from a kernel info; the op type itself carries a hash of
// every activation, so a node only reaches this kernel when its activations match.)
OrtStatusPtr CheckAttributes(const KernelEntry& e, const OrtKernelInfo* info) {
  Ort::ConstKernelInfo ki(info);
  std::vector<int64_t> widths;
  try {
    widths = ki.GetAttributes<int64_t>("widths");
  } catch (const Ort::Exception&) {
    return Error(ORT_INVALID_GRAPH, std::string(kDomain) + "." + e.name +
                                        ": the node has no `widths` attribute; the library was built for a "
                                        "different model (re-run onnx2fused convert)");
  }
  std::vector<int64_t> expected(e.widths, e.widths + e.num_layers + 1);
  if (widths != expected) {
    return Error(ORT_INVALID_GRAPH, std::string(kDomain) + "." + e.name + ": the node has widths " +
                                        ShapeText(widths) + " but the library was built for a different model (widths " +
                                        WidthsText(e) + "); re-run onnx2fused convert");
  }
  return nullptr;
}

template <class Kernel>
Kernel* MakeKernel(const KernelEntry* e, const OrtKernelInfo*) { return new Kernel(e); }
template <>
StockCpuKernel* MakeKernel<StockCpuKernel>(const KernelEntry* e, const OrtKernelInfo* info) {
  return new StockCpuKernel(e, info);
}

template <class Kernel>
struct FusedOp : Ort::CustomOpBase<FusedOp<Kernel>, Kernel, true> {
  const KernelEntry* e;
  const char* ep;
  FusedOp(const KernelEntry* entry, const char* provider) : e(entry), ep(provider) {}

  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return Guard([&]() -> OrtStatusPtr {
      if (OrtStatusPtr st = CheckAttributes(*e, info)) return st;
      *kernel = MakeKernel<Kernel>(e, info);
      return nullptr;
    });
  }
  const char* GetName() const { return e->name; }
  const char* GetExecutionProviderType() const { return ep; }
  size_t GetInputTypeCount() const { return InputCount(*e); }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? IoType(*e) : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return IoType(*e); }
};

struct Registry {
  std::vector<std::unique_ptr<FusedOp<CpuKernel>>> cpu_ops;
  std::vector<std::unique_ptr<FusedOp<StockCpuKernel>>> stock_cpu_ops;
#ifdef ONNX2FUSED_WITH_CUDA
  std::vector<std::unique_ptr<FusedOp<CudaKernel>>> cuda_ops;
#endif
  std::vector<OrtCustomOpDomain*> domains;  // must outlive every session: never released
  std::mutex mu;
};

Registry& TheRegistry() {
  static Registry* r = [] {
    auto* reg = new Registry();  // leaked on purpose: sessions may outlive static destruction
    for (int i = 0; i < kNumKernels; ++i) {
      const KernelEntry* e = &kKernels[i];
      if (e->cpu) {
        reg->cpu_ops.emplace_back(new FusedOp<CpuKernel>(e, "CPUExecutionProvider"));
      } else {
        reg->stock_cpu_ops.emplace_back(new FusedOp<StockCpuKernel>(e, "CPUExecutionProvider"));
      }
#ifdef ONNX2FUSED_WITH_CUDA
      if (e->cuda_run || e->cuda_run_pool) reg->cuda_ops.emplace_back(new FusedOp<CudaKernel>(e, "CUDAExecutionProvider"));
#endif
    }
    return reg;
  }();
  return *r;
}

}  // namespace
}  // namespace onnx2fused

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (!api) return nullptr;  // cannot even report: the runtime is older than the headers
  Ort::InitApi(api);
  using namespace onnx2fused;
  return Guard([&]() -> OrtStatusPtr {
    Registry& reg = TheRegistry();
    std::lock_guard<std::mutex> lock(reg.mu);
    OrtCustomOpDomain* domain = nullptr;
    if (OrtStatusPtr st = api->CreateCustomOpDomain(kDomain, &domain)) return st;
    reg.domains.push_back(domain);
    for (auto& op : reg.cpu_ops)
      if (OrtStatusPtr st = api->CustomOpDomain_Add(domain, op.get())) return st;
    for (auto& op : reg.stock_cpu_ops)
      if (OrtStatusPtr st = api->CustomOpDomain_Add(domain, op.get())) return st;
#ifdef ONNX2FUSED_WITH_CUDA
    for (auto& op : reg.cuda_ops)
      if (OrtStatusPtr st = api->CustomOpDomain_Add(domain, op.get())) return st;
#endif
    return api->AddCustomOpDomain(options, domain);
  });
}
