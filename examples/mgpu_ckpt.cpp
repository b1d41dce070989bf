// mgpu_ckpt: what a checkpoint holds, and conversions. A checkpoint is a file (one process's save)
// or a folder of shards (a save across processes, or into a folder); every executor writes the same
// records, so any of them is read the same way.
//
//   mgpu_ckpt info run.ckpt                    the layout (file, or folder: save id, shards), the
//                                              model (a GPT's config), step, optimizer, loss scaler
//                                              and every record (name, type, shape; split or whole)
//   mgpu_ckpt convert run.ckpt one.ckpt        one file holding every record (a folder's pieces
//                                              joined), which any layout loads
//   mgpu_ckpt convert run.ckpt gpt.bin --llmc  the GPT's float32 parameters as an llm.c model file
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include <mgpu/mgpu.hpp>

namespace {

namespace fs = std::filesystem;
using mgpu::io::Checkpoint;

// Every record of a file or folder, joined: a folder's split records whole.
Checkpoint read_all(fs::path const& path) {
  return fs::is_directory(path) ? mgpu::io::ShardedCheckpoint::load(path).joined() : Checkpoint::load(path);
}

// The GPT whose layers' names the architecture record lists (nn::gpt's: Embedding, the blocks, the
// final LayerNorm, the tied head), or nullopt for another model.
std::optional<mgpu::nn::GptConfig> gpt_config(std::string const& architecture) {
  std::smatch m;
  static std::regex const embedding(R"(^Embedding\((\d+), (\d+), (\d+)\))");
  static std::regex const block(R"(TransformerBlock\((\d+), heads (\d+)\))");
  if (!std::regex_search(architecture, m, embedding)) return std::nullopt;
  mgpu::nn::GptConfig config{.vocab = std::stoll(m[1]), .block_size = std::stoll(m[2]), .n_embd = std::stoll(m[3])};
  config.n_layer = 0;
  for (auto it = std::sregex_iterator(architecture.begin(), architecture.end(), block); it != std::sregex_iterator(); ++it) {
    config.n_head = std::stoll((*it)[2]);
    ++config.n_layer;
  }
  if (config.n_layer == 0 || !architecture.ends_with("TiedLMHead(" + std::to_string(config.vocab) + ", " + std::to_string(config.n_embd) + ")"))
    return std::nullopt;
  return config;
}

std::string line_of(std::string const& name, mgpu::io::RecordType type, mgpu::Shape const& shape, char const* how) {
  char text[256];
  std::snprintf(text, sizeof text, "  %-40s %-8s %-16s %s", name.c_str(), mgpu::io::to_string(type).c_str(),
                mgpu::to_string(shape).c_str(), how);
  return text;
}

void info(fs::path const& path) {
  std::vector<std::string> lines;
  Checkpoint whole;  // the whole records, for the summary
  if (fs::is_directory(path)) {
    auto const sharded = mgpu::io::ShardedCheckpoint::load(path);
    std::printf("%s: a folder of %d shard(s), save %llu, format version %d\n", path.c_str(), sharded.shards(),
                static_cast<unsigned long long>(sharded.save_id()), sharded.version());
    // A split tensor's boxes (or element ranges) and the shard of each, the first few.
    auto const where = [&sharded](std::string const& name) {
      auto const parts = sharded.parts(name);
      std::string text = sharded.split_by_elements(name) ? "element ranges" : "boxes";
      for (std::size_t i = 0; i < parts.size() && i < 6; ++i)
        text += " " + mgpu::io::to_string(parts[i].box) + "@" + std::to_string(parts[i].shard);
      if (parts.size() > 6) text += " and " + std::to_string(parts.size() - 6) + " more";
      return text;
    };
    for (std::string const& name : sharded.split_names()) {
      if (!sharded.is_layout(name)) {
        lines.push_back(line_of(name, sharded.type(name), sharded.shape(name), where(name).c_str()));
        continue;
      }
      auto const tensors = sharded.layout_tensors(name);
      lines.push_back(line_of(name, sharded.type(name), sharded.shape(name),
                              ("the " + std::to_string(tensors.size()) + " tensors below laid end to end").c_str()));
      for (std::string const& tensor : tensors)
        lines.push_back(line_of("  " + tensor, sharded.type(tensor), sharded.shape(tensor), where(tensor).c_str()));
    }
    whole = sharded.whole();
  } else {
    std::printf("%s: one file, %ju bytes\n", path.c_str(), static_cast<std::uintmax_t>(fs::file_size(path)));
    whole = Checkpoint::load(path);  // every record verified against its checksum
  }
  for (mgpu::io::Record const& r : whole.records()) lines.push_back(line_of(r.name, r.type, r.shape, "whole"));
  if (whole.contains("model.architecture")) {
    std::string const architecture = whole.get_text("model.architecture");
    if (auto const c = gpt_config(architecture))
      std::printf("model: GPT, n_layer %lld, n_head %lld, n_embd %lld, block %lld, vocab %lld\n",
                  static_cast<long long>(c->n_layer), static_cast<long long>(c->n_head), static_cast<long long>(c->n_embd),
                  static_cast<long long>(c->block_size), static_cast<long long>(c->vocab));
    else
      std::printf("model: %s\n", architecture.c_str());
  }
  if (whole.contains("training")) {
    auto const t = whole.get_int64("training");
    if (t.size() == 3) std::printf("training: step %lld, epoch %lld, batch %lld\n", static_cast<long long>(t[0]),
                                   static_cast<long long>(t[1]), static_cast<long long>(t[2]));
  }
  if (whole.contains("optimizer.name")) {
    auto const steps = whole.contains("optimizer.steps") ? whole.get_int64("optimizer.steps") : std::vector<std::int64_t>{};
    std::printf("optimizer: %s, %lld steps\n", whole.get_text("optimizer.name").c_str(),
                static_cast<long long>(steps.empty() ? 0 : steps[0]));
  }
  if (auto const s = mgpu::io::read_loss_scaler(whole, path.string(), mgpu::optim::LossScaler{}))
    std::printf("loss scaler: scale %g, %lld good steps, %lld skipped\n", static_cast<double>(s->scale),
                static_cast<long long>(s->good_steps), static_cast<long long>(s->skipped));
  std::printf("records:\n");
  for (std::string const& l : lines) std::printf("%s\n", l.c_str());
}

void convert(fs::path const& from, fs::path const& to, bool llmc) {
  Checkpoint const records = read_all(from);
  if (!llmc) {
    records.save(to);  // atomically
    std::printf("%s: every record of %s in one file\n", to.c_str(), from.c_str());
    return;
  }
  std::string const architecture = records.get_text("model.architecture");
  std::optional<mgpu::nn::GptConfig> const config = gpt_config(architecture);
  if (!config)
    throw mgpu::Error(mgpu::Errc::invalid_argument, from.string() + " holds the model '" + architecture +
                                                        "' (expected a GPT, nn::gpt's layers, for --llmc)");
  mgpu::io::Record const& params = records.get("model.parameters");
  auto const expected = mgpu::nn::gpt(*config).parameter_count();
  if (params.type != mgpu::io::RecordType::float32 || params.shape != mgpu::Shape{expected})
    throw mgpu::Error(mgpu::Errc::corrupt_data, from.string() + ": model.parameters is " + mgpu::io::to_string(params.type) + " " +
                                                    mgpu::to_string(params.shape) + " (expected float32 [" + std::to_string(expected) + "])");
  std::span<float const> values(reinterpret_cast<float const*>(params.data.data()), static_cast<std::size_t>(expected));
  mgpu::io::write_llmc_model(to, *config, values);
  std::printf("%s: the GPT's parameters as an llm.c model file (n_layer %lld, n_embd %lld)\n", to.c_str(),
              static_cast<long long>(config->n_layer), static_cast<long long>(config->n_embd));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"mgpu_ckpt: what a checkpoint (file or folder of shards) holds, and conversions"};
  app.require_subcommand(1);
  std::string path, out;
  bool llmc = false;
  CLI::App* info_cmd = app.add_subcommand("info", "print the layout, model, step, optimizer and every record");
  info_cmd->add_option("checkpoint", path, "a checkpoint file or folder")->required();
  CLI::App* convert_cmd = app.add_subcommand("convert", "write the checkpoint as one file, or (--llmc) an llm.c model file");
  convert_cmd->add_option("checkpoint", path, "a checkpoint file or folder")->required();
  convert_cmd->add_option("out", out, "the file to write")->required();
  convert_cmd->add_flag("--llmc", llmc, "the GPT's parameters as an llm.c model file");
  CLI11_PARSE(app, argc, argv);
  try {
    if (*info_cmd) info(path);
    if (*convert_cmd) convert(path, out, llmc);
  } catch (mgpu::Error const& e) {
    std::fprintf(stderr, "mgpu_ckpt: %s\n", e.what());
    return 1;
  }
  return 0;
}
