// ParallelConfig: which layouts can run, refused before any work with the field (or flag) and the
// value expected.
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/parallel/zero_stages.hpp>
#include <mgpu/train/trainer.hpp>

namespace mgpu::train {

namespace {

// The names of the config's parts in the messages: its fields, or train_gpt's flags.
struct Names {
  bool flags;
  [[nodiscard]] std::string operator()(char const* field, char const* flag) const { return flags ? flag : field; }
};

std::string precision_name(DType compute) {
  return compute == DType::bfloat16 ? "bf16" : compute == DType::float16 ? "fp16" : compute == DType::float32 ? "fp32"
                                                                                                              : std::string(to_string(compute));
}

[[noreturn]] void refuse(std::string const& what) { throw Error(Errc::invalid_argument, what); }

}  // namespace

ParallelConfig ParallelConfig::from_plan(plan::Layout const& layout) {
  ParallelConfig c;
  c.dp = layout.data_parallel, c.tp = layout.tensor_parallel, c.stages = layout.stages;
  c.micro_batches = layout.micro_batches, c.cuts = layout.cuts;
  c.sequence_parallel = layout.sequence_parallel, c.recompute = layout.recompute;
  if (layout.stages > 1) c.schedule = "1f1b";
  if (parallel::max_zero_stage(c.compute, c.pipelined()) >= 0) c.zero = layout.zero_stage;  // where the replicas take a stage
  return c;
}

int ParallelConfig::devices() const noexcept {
  if (tp > 1) return dp * tp * (pipelined() ? stages : 1);
  return pipelined() ? stages * dp : dp;
}

void ParallelConfig::validate(nn::GptConfig const& model, LayoutChecks const& checks) const {
  Names const name{checks.spelling == Spelling::flags};
  std::string const n_zero = name("zero ", "--zero ") + std::to_string(zero.value_or(1));
  std::string const n_tp = name("tp ", "--tp ") + std::to_string(tp);
  std::string const n_dp = name("dp", "--dp");
  bool const pipe = pipelined();
  int const size = checks.devices;
  std::string const devices_text = name("", "--devices ") + (name.flags ? checks.devices_text + " has " : "") +
                                   std::to_string(size) + " devices";
  // A step's rows: at least one per replica (and per micro-batch of a pipeline).
  auto const refuse_rows = [&](int least) {
    refuse(name("batch_size ", "--batch-size ") + std::to_string(checks.batch_size) + " with " + n_dp + " " +
           std::to_string(pipe || tp > 1 ? dp : size) + (pipe ? " and " + name("micro_batches ", "--micro-batches ") + std::to_string(micro_batches) : "") +
           " (expected at least " + std::to_string(least) + ": one row per replica" + (pipe ? " and micro-batch)" : ")"));
  };
  if (dp < 1 || tp < 1 || stages < 1 || micro_batches < 1 || chunks < 1)
    refuse(name("dp ", "--dp ") + std::to_string(dp) + ", " + n_tp + ", " + name("stages ", "--stages ") +
           std::to_string(stages) + ", " + name("micro_batches ", "--micro-batches ") + std::to_string(micro_batches) +
           ", " + name("chunks ", "--chunks ") + std::to_string(chunks) + " (expected each at least 1)");
  if (compute != DType::float32 && compute != DType::bfloat16 && compute != DType::float16)
    refuse(name("compute ", "--precision ") + precision_name(compute) + " (expected fp32, bf16 or fp16)");
  if (zero && (*zero < 0 || *zero > parallel::max_zero_stage(compute, pipe)))  // 3 in every layout and precision
    refuse(n_zero + " (expected 0, the replicated update, 1, ZeRO-1: the sharded update and "
           "optimizer state, 2, ZeRO-2: the gradients sharded too, or 3, ZeRO-3: the parameters too)");
  if (bucket_cap_bytes > 0 && pipe)
    refuse(name("bucket_cap_bytes", "--bucket-kb") + " with a pipeline (expected " +
           name("bucket_cap_bytes", "--bucket-kb") + " with data or tensor parallelism: a pipeline's replicas do not bucket)");
  if (sequence_parallel && tp < 2)
    refuse(name("sequence_parallel", "--sequence-parallel") + " with " + n_tp + " (expected " + name("tp", "--tp") +
           " 2 or more: it splits the tensor-parallel devices' tokens)");
  if (pipe && pipeline_schedule() == "layer-split" && micro_batches != 1)
    refuse(name("schedule", "--schedule") + " layer-split with " + name("micro_batches ", "--micro-batches ") +
           std::to_string(micro_batches) + " (expected 1: one batch through the stages in turn)");
  if (tp > 1) {
    if (model.n_head % tp != 0)
      refuse(n_tp + " with " + name("n_head ", "--n-head ") + std::to_string(model.n_head) + " (expected " +
             name("tp", "--tp") + " dividing " + name("n_head", "--n-head") + ": each device holds whole heads)");
    if (model.vocab < tp)
      refuse(n_tp + " with a vocab of " + std::to_string(model.vocab) + " (expected " + name("tp", "--tp") +
             " at most the vocab: each device holds at least one token id)");
    if (sequence_parallel && model.block_size % tp != 0)
      refuse(name("sequence_parallel", "--sequence-parallel") + " with " + name("block_size ", "--block-size ") +
             std::to_string(model.block_size) + " over " + n_tp + " (expected a block size divisible by " +
             name("tp", "--tp") + ")");
    if (size != devices())
      refuse(devices_text + " (expected " + n_dp + " x " + name("tp", "--tp") +
             (pipe ? " x " + name("stages", "--stages") + " = " : " = ") + std::to_string(devices()) + ")");
    if (checks.batch_size > 0 && checks.batch_size < dp * (pipe ? micro_batches : 1))
      refuse_rows(dp * (pipe ? micro_batches : 1));
    return;
  }
  if (pipe) {
    if (size != devices())
      refuse(devices_text + " (expected " + name("stages", "--stages") + " x " + n_dp + " = " +
             std::to_string(devices()) + ")");
    if (checks.batch_size > 0 && checks.batch_size < dp * micro_batches) refuse_rows(dp * micro_batches);
    return;
  }
  if (micro_batches != 1)
    refuse(name("micro_batches ", "--micro-batches ") + std::to_string(micro_batches) + " without a pipeline (expected " +
           name("a schedule or stages > 1", "--schedule or --stages > 1") + ": micro-batches are a pipeline's)");
  if (dp != 1 && dp != size)
    refuse(n_dp + " " + std::to_string(dp) + " with " + name("", "--devices ") +
           (name.flags ? checks.devices_text : std::to_string(size) + " devices") + " (expected the number of devices, " +
           std::to_string(size) + ": one replica per device)");
  if (checks.batch_size > 0 && checks.batch_size < size) refuse_rows(size);
}

}  // namespace mgpu::train
