// Replica checkpoints (see corpc/ddp/replica_checkpoint.hpp): stage files, and loading them into a whole model.
#include "corpc/ddp/replica_checkpoint.hpp"

#include <torch/serialize.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <vector>

#include "corpc/rpc/errors.hpp"

#include "ddp/optimizer_bytes.hpp"
#include "ddp/replica_checkpoint_files.hpp"

namespace corpc::ddp {

namespace ckpt_detail {

namespace {

namespace fs = std::filesystem;

// Module::save's layout, with copies: the module's own parameters and buffers, then each child as an archive of
// its own under its name.
void copy_module(const torch::nn::Module& module, torch::serialize::OutputArchive& out) {
  for (const auto& p : module.named_parameters(/*recurse=*/false)) out.write(p.key(), p.value().detach().clone());
  for (const auto& b : module.named_buffers(/*recurse=*/false))
    out.write(b.key(), b.value().detach().clone(), /*is_buffer=*/true);
  for (const auto& c : module.named_children()) {
    torch::serialize::OutputArchive child;
    copy_module(*c.value(), child);
    out.write(c.key(), child);
  }
}

std::int64_t read_int(torch::serialize::InputArchive& in, const char* key, const std::string& file) {
  at::Tensor t;
  if (!in.try_read(key, t)) throw UsageError("replica checkpoint: " + file + " is not a stage file (no " + key + ")");
  return t.item<std::int64_t>();
}

}  // namespace

void check_loadable(const torch::nn::Module& module, torch::serialize::InputArchive& in, const std::string& where) {
  auto check = [&](const std::string& key, const at::Tensor& mine, bool buffer) {
    at::Tensor theirs;
    if (!in.try_read(key, theirs, buffer))
      throw UsageError("replica checkpoint: " + where + " has no " + (buffer ? "buffer" : "parameter") + " '" + key +
                       "'");
    if (theirs.sizes() != mine.sizes()) {
      std::ostringstream why;
      why << "replica checkpoint: " << where << "'s '" << key << "' is " << theirs.sizes() << ", the model's "
          << mine.sizes();
      throw UsageError(why.str());
    }
  };
  for (const auto& p : module.named_parameters(/*recurse=*/false)) check(p.key(), p.value(), false);
  for (const auto& b : module.named_buffers(/*recurse=*/false)) check(b.key(), b.value(), true);
  for (const auto& c : module.named_children()) {
    torch::serialize::InputArchive child;
    if (!in.try_read(c.key(), child))
      throw UsageError("replica checkpoint: " + where + " has no layer '" + c.key() + "'");
    check_loadable(*c.value(), child, where + "/" + c.key());
  }
}

torch::serialize::OutputArchive snapshot_stage(const torch::nn::Sequential& layers, torch::optim::Optimizer& optimizer,
                                               const StageMeta& meta) {
  torch::NoGradGuard no_grad;
  torch::serialize::OutputArchive archive, copy;
  copy_module(*layers, copy);
  archive.write("layers", copy);
  archive.write("optimizer", detail::optimizer_bytes(optimizer));
  archive.write("step", at::tensor({meta.step}, at::kLong));
  archive.write("stage", at::tensor({static_cast<std::int64_t>(meta.stage)}, at::kLong));
  archive.write("stages", at::tensor({static_cast<std::int64_t>(meta.stages)}, at::kLong));
  archive.write("first_layer", at::tensor({static_cast<std::int64_t>(meta.first_layer)}, at::kLong));
  archive.write("layer_count", at::tensor({static_cast<std::int64_t>(meta.layers)}, at::kLong));
  return archive;
}

std::string stage_file(const std::string& step_dir, int stage, int stages) {
  return (fs::path(step_dir) / ("stage-" + std::to_string(stage) + "-of-" + std::to_string(stages) + ".pt")).string();
}

void write_stage(torch::serialize::OutputArchive& archive, const std::string& step_dir, const StageMeta& meta) {
  std::error_code ec;
  fs::create_directories(step_dir, ec);
  if (ec) throw RpcError("replica checkpoint: cannot make " + step_dir + ": " + ec.message());
  const std::string path = stage_file(step_dir, meta.stage, meta.stages), tmp = path + ".tmp";
  archive.save_to(tmp);
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw RpcError("replica checkpoint: cannot rename " + tmp + ": " + std::strerror(errno));
}

StageFile read_stage(const std::string& step_dir, int stage, int stages) {
  const std::string path = stage_file(step_dir, stage, stages);
  if (!fs::exists(path)) throw UsageError("replica checkpoint: " + path + " is missing");
  StageFile f;
  torch::serialize::InputArchive in;
  try {
    in.load_from(path);
  } catch (const c10::Error& e) {
    throw UsageError("replica checkpoint: " + path + " is not a stage file: " + e.what_without_backtrace());
  }
  f.meta.step = read_int(in, "step", path);
  f.meta.stage = static_cast<int>(read_int(in, "stage", path));
  f.meta.stages = static_cast<int>(read_int(in, "stages", path));
  f.meta.first_layer = static_cast<int>(read_int(in, "first_layer", path));
  f.meta.layers = static_cast<int>(read_int(in, "layer_count", path));
  if (f.meta.stage != stage || f.meta.stages != stages)
    throw UsageError("replica checkpoint: " + path + " holds stage " + std::to_string(f.meta.stage) + " of " +
                     std::to_string(f.meta.stages));
  if (!in.try_read("layers", f.layers)) throw UsageError("replica checkpoint: " + path + " has no layers");
  at::Tensor bytes;
  if (!in.try_read("optimizer", bytes)) throw UsageError("replica checkpoint: " + path + " has no optimizer state");
  try {
    f.optimizer = detail::optimizer_archive(bytes);
  } catch (const c10::Error& e) {
    throw UsageError("replica checkpoint: " + path + "'s optimizer state does not read: " + e.what_without_backtrace());
  }
  return f;
}

int stage_count(const std::string& step_dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(step_dir, ec)) {
    const std::string name = e.path().filename().string();
    int stage = 0, stages = 0;
    char tail[4] = {};
    if (std::sscanf(name.c_str(), "stage-%d-of-%d.%3s", &stage, &stages, tail) == 3 && std::string(tail) == "pt" &&
        stages > 0)
      return stages;
  }
  throw UsageError("replica checkpoint: " + step_dir + " has no stage file" + (ec ? " (" + ec.message() + ")" : ""));
}

}  // namespace ckpt_detail

std::string replica_checkpoint_dir(const std::string& root, std::int64_t step) {
  return (std::filesystem::path(root) / ("step-" + std::to_string(step))).string();
}

std::string latest_replica_checkpoint(const std::string& root) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::int64_t best = -1;
  std::string found;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    long long step = -1;
    if (std::sscanf(e.path().filename().string().c_str(), "step-%lld", &step) != 1 || step <= best) continue;
    const std::string dir = e.path().string();
    try {
      const int stages = ckpt_detail::stage_count(dir);
      bool whole = true;
      for (int s = 0; s < stages && whole; ++s) whole = fs::exists(ckpt_detail::stage_file(dir, s, stages));
      if (whole) best = step, found = dir;
    } catch (const UsageError&) {  // no stage file yet
    }
  }
  return found;
}

std::int64_t load_replica_checkpoint(torch::nn::Sequential model, const std::string& step_dir) {
  const int stages = ckpt_detail::stage_count(step_dir);
  std::vector<ckpt_detail::StageFile> files;
  for (int s = 0; s < stages; ++s) files.push_back(ckpt_detail::read_stage(step_dir, s, stages));
  // Every layer of the model in exactly one file, and one step: checked before anything is loaded.
  int next = 0;
  for (const auto& f : files) {
    if (f.meta.step != files[0].meta.step)
      throw UsageError("replica checkpoint: " + step_dir + " mixes steps " + std::to_string(files[0].meta.step) +
                       " and " + std::to_string(f.meta.step));
    if (f.meta.first_layer != next)
      throw UsageError("replica checkpoint: " + step_dir + ": stage " + std::to_string(f.meta.stage) +
                       " starts at layer " + std::to_string(f.meta.first_layer) + ", not " + std::to_string(next));
    next += f.meta.layers;
  }
  if (next != static_cast<int>(model->size()))
    throw UsageError("replica checkpoint: " + step_dir + " holds " + std::to_string(next) + " layers; the model has " +
                     std::to_string(model->size()));
  // Each layer's archive, every shape checked against the model's before anything is loaded.
  const auto children = model->named_children();
  std::vector<std::pair<torch::nn::Module*, torch::serialize::InputArchive>> layers;
  for (auto& f : files)
    for (int l = f.meta.first_layer; l < f.meta.first_layer + f.meta.layers; ++l) {
      const auto& child = children[static_cast<size_t>(l)];
      const std::string where = "stage " + std::to_string(f.meta.stage) + " of " + step_dir;
      torch::serialize::InputArchive layer;
      if (!f.layers.try_read(child.key(), layer))
        throw UsageError("replica checkpoint: " + where + " has no layer '" + child.key() + "'");
      ckpt_detail::check_loadable(*child.value(), layer, where + ", layer " + child.key());
      layers.emplace_back(child.value().get(), std::move(layer));
    }
  for (auto& [module, archive] : layers) module->load(archive);
  return files[0].meta.step;
}

}  // namespace corpc::ddp
