// kvcached._C: the Python face of the data plane. Tensors leave as DLPack
// capsules over the FTensor's stable address (no copy, no torch dependency);
// every call that may touch the driver releases the GIL.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "kvcached/backend.hpp"
#include "kvcached/dlpack.h"
#include "kvcached/errors.hpp"
#include "kvcached/fault_injection.hpp"
#include "kvcached/ftensor.hpp"
#include "kvcached/ftensor_allocator.hpp"
#include "kvcached/mem_info_tracker.hpp"
#include "kvcached/page_allocator.hpp"

namespace py = pybind11;
using namespace kvcached;

namespace {

// ---- DLPack ---------------------------------------------------------------
struct CapsuleCtx {
  std::shared_ptr<FTensor> owner;  // keeps the address range alive
  int64_t shape[1];
  int64_t strides[1];
};

void dl_deleter(DLManagedTensor* self) {
  delete static_cast<CapsuleCtx*>(self->manager_ctx);
  delete self;
}

void capsule_destructor(PyObject* cap) {
  // Consumers rename a capsule they took ("used_dltensor"); only an unused one is ours to free.
  if (PyCapsule_IsValid(cap, "dltensor")) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
    if (m && m->deleter) m->deleter(m);
  }
}

py::capsule to_dlpack(const std::shared_ptr<FTensor>& t) {
  auto* ctx = new CapsuleCtx{t, {static_cast<int64_t>(t->size())}, {1}};
  auto* m = new DLManagedTensor();
  m->dl_tensor.data = reinterpret_cast<void*>(t->data());
  m->dl_tensor.device = {t->backend()->dlpack_device_type(), t->backend()->device().index};
  m->dl_tensor.ndim = 1;
  m->dl_tensor.dtype = {kDLUInt, 8, 1};
  m->dl_tensor.shape = ctx->shape;
  m->dl_tensor.strides = ctx->strides;
  m->dl_tensor.byte_offset = 0;
  m->manager_ctx = ctx;
  m->deleter = dl_deleter;
  return py::capsule(static_cast<void*>(m), "dltensor", capsule_destructor);
}

// ---- Mapper implemented in Python (e.g. the fan-out to worker processes) ----
class PyMapper final : public Mapper {
 public:
  PyMapper(py::function map, py::function unmap) : map_(std::move(map)), unmap_(std::move(unmap)) {}
  ~PyMapper() override {
    py::gil_scoped_acquire g;
    map_ = py::function();
    unmap_ = py::function();
  }
  void map(const std::vector<int64_t>& offsets) override { call(map_, offsets); }
  void unmap(const std::vector<int64_t>& offsets) override { call(unmap_, offsets); }

 private:
  static void call(const py::function& f, const std::vector<int64_t>& offsets) {
    py::gil_scoped_acquire g;
    try {
      f(offsets);
    } catch (py::error_already_set& e) {
      // Python-side kvcached errors carry their kind in `kvcached_kind`.
      ErrorKind kind = ErrorKind::Backend;
      if (py::hasattr(e.value(), "kvcached_kind")) {
        kind = static_cast<ErrorKind>(e.value().attr("kvcached_kind").cast<int>());
      }
      fail(kind, e.what());
    }
  }
  py::function map_, unmap_;
};

// ---- integer arguments -------------------------------------------------------
// pybind's own casters turn a bool into 1, and a float, 2**64 or a string into
// an untyped TypeError ("incompatible function arguments"). These give
// InvalidArgumentError naming the argument instead, and take any object with
// __index__ (numpy and torch integers included).
std::string type_name(PyObject* o) { return Py_TYPE(o)->tp_name; }

int64_t to_i64(py::handle h, const char* what) {
  PyObject* o = h.ptr();
  if (PyBool_Check(o) || !PyIndex_Check(o)) {
    invalid(std::string(what) + " must be an integer, got " + type_name(o));
  }
  int overflow = 0;
  long long v = 0;
  if (PyLong_CheckExact(o)) {
    v = PyLong_AsLongLongAndOverflow(o, &overflow);
  } else {
    py::object idx = py::reinterpret_steal<py::object>(PyNumber_Index(o));
    if (!idx) {
      PyErr_Clear();
      invalid(std::string(what) + " must be an integer, got " + type_name(o));
    }
    v = PyLong_AsLongLongAndOverflow(idx.ptr(), &overflow);
  }
  if (overflow) invalid(std::string(what) + " is outside the 64-bit integer range");
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    invalid(std::string(what) + " must be an integer, got " + type_name(o));
  }
  return v;
}

int64_t to_i64_in(py::handle h, const char* what, int64_t lo, int64_t hi) {
  int64_t v = to_i64(h, what);
  if (v < lo) invalid(std::string(what) + " must be >= " + std::to_string(lo) + ", got " + std::to_string(v));
  if (v > hi) invalid(std::string(what) + " must be <= " + std::to_string(hi) + ", got " + std::to_string(v));
  return v;
}

size_t to_size(py::handle h, const char* what) {
  return static_cast<size_t>(to_i64_in(h, what, 0, INT64_MAX));
}

std::vector<int64_t> to_i64_list(py::handle h, const char* what) {
  PyObject* o = h.ptr();
  if (PyUnicode_Check(o) || PyBytes_Check(o) || PyByteArray_Check(o)) {
    invalid(std::string(what) + " must be a sequence of integers, got " + type_name(o));
  }
  py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(o, ""));
  if (!seq) {
    PyErr_Clear();
    invalid(std::string(what) + " must be a sequence of integers, got " + type_name(o));
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) out.push_back(to_i64(items[i], what));
  return out;
}

int to_group(py::handle h) { return static_cast<int>(to_i64_in(h, "group_id", 0, INT32_MAX)); }

std::shared_ptr<FTensorAllocator> group_of(int group_id) { return registry::group(group_id, false); }

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvcached data plane: elastic KV tensors over CUDA/HIP VMM or host memory";

  // ---- exceptions: one type per ErrorKind ----------------------------------
  static py::exception<Error> base_exc(m, "KvcachedError", PyExc_RuntimeError);
  static py::object invalid_exc = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "kvcached._C.InvalidArgumentError", "Bad input; nothing was changed.",
      py::make_tuple(base_exc, py::handle(PyExc_ValueError)).release().ptr(), nullptr));
  static py::object oom_exc = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "kvcached._C.OutOfMemoryError", "Physical memory pressure; recoverable, nothing was changed.",
      py::make_tuple(base_exc, py::handle(PyExc_MemoryError)).release().ptr(), nullptr));
  static py::object consistency_exc = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "kvcached._C.StateConsistencyError", "A rollback failed; the pool refuses work (fail closed).",
      py::make_tuple(base_exc).release().ptr(), nullptr));
  static py::object backend_exc = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "kvcached._C.BackendError", "A driver/OS call failed and was rolled back.",
      py::make_tuple(base_exc).release().ptr(), nullptr));
  static py::object shutdown_exc = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "kvcached._C.ShutdownError", "Use after shutdown_kvcached() or before init_kvcached().",
      py::make_tuple(base_exc).release().ptr(), nullptr));
  m.attr("InvalidArgumentError") = invalid_exc;
  m.attr("OutOfMemoryError") = oom_exc;
  m.attr("StateConsistencyError") = consistency_exc;
  m.attr("BackendError") = backend_exc;
  m.attr("ShutdownError") = shutdown_exc;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* type = base_exc.ptr();
      switch (e.kind()) {
        case ErrorKind::InvalidArgument: type = invalid_exc.ptr(); break;
        case ErrorKind::OutOfMemory: type = oom_exc.ptr(); break;
        case ErrorKind::StateConsistency: type = consistency_exc.ptr(); break;
        case ErrorKind::Backend: type = backend_exc.ptr(); break;
        case ErrorKind::Shutdown: type = shutdown_exc.ptr(); break;
      }
      PyErr_SetString(type, e.what());
    }
  });
  m.attr("ERROR_KIND_INVALID_ARGUMENT") = static_cast<int>(ErrorKind::InvalidArgument);
  m.attr("ERROR_KIND_OUT_OF_MEMORY") = static_cast<int>(ErrorKind::OutOfMemory);
  m.attr("ERROR_KIND_STATE_CONSISTENCY") = static_cast<int>(ErrorKind::StateConsistency);
  m.attr("ERROR_KIND_BACKEND") = static_cast<int>(ErrorKind::Backend);
  m.attr("ERROR_KIND_SHUTDOWN") = static_cast<int>(ErrorKind::Shutdown);

  using release_gil = py::call_guard<py::gil_scoped_release>;

  // ---- global (upstream-style) API -----------------------------------------
  m.def("init_kvcached", &registry::init, py::arg("device"), py::arg("page_size"), py::arg("contiguous_layout"),
        release_gil());
  m.def("shutdown_kvcached", &registry::shutdown, release_gil(),
        "Releases every physical page; returns the bytes that could not be released (quarantined).");
  m.def("quarantined_bytes", &quarantined_bytes_total,
        "Bytes of KV memory of this process that could not be released and stay allocated.");
  m.def("is_initialized", &registry::initialized);
  m.def("config", [] {
    auto c = registry::config();
    return py::dict(py::arg("device") = c.device, py::arg("page_size") = c.page_size,
                    py::arg("contiguous_layout") = c.contiguous);
  });
  m.def(
      "create_kv_tensors",
      [](size_t size, size_t num_layers, size_t num_kv_buffers, int group_id) {
        std::shared_ptr<FTensorAllocator> a;
        {
          py::gil_scoped_release nogil;
          a = registry::group(group_id, true);
          a->create_kv_tensors(size, num_layers, num_kv_buffers);
        }
        py::list out;
        for (auto& t : a->tensors()) out.append(to_dlpack(t));
        return out;
      },
      py::arg("size"), py::arg("num_layers"), py::arg("num_kv_buffers") = 2, py::arg("group_id") = 0,
      "Creates the KV tensors of a group; returns one DLPack capsule per FTensor.");
  m.def(
      "raw_kv_tensors",
      [](int group_id) {
        py::list out;
        for (auto& t : group_of(group_id)->tensors()) out.append(to_dlpack(t));
        return out;
      },
      py::arg("group_id") = 0);
  m.def(
      "kv_tensors_created",
      [](int group_id) {
        if (!registry::initialized()) return false;
        for (auto& a : registry::all_groups())
          if (a->group_id() == group_id) return a->created();
        return false;
      },
      py::arg("group_id") = 0);
  m.def(
      "map_to_kv_tensors",
      [](py::object offs, py::object g) {
        auto o = to_i64_list(offs, "offsets");
        int gid = to_group(g);
        py::gil_scoped_release nogil;
        group_of(gid)->map(o);
      },
      py::arg("offsets"), py::arg("group_id") = 0);
  m.def(
      "map_to_kv_tensors_with_result",
      [](py::object offs, py::object g) {
        auto o = to_i64_list(offs, "offsets");
        int gid = to_group(g);
        MapResult r;
        {
          py::gil_scoped_release nogil;
          r = group_of(gid)->map_with_result(o);
        }
        return py::make_tuple(r.newly_mapped, r.already_mapped);
      },
      py::arg("offsets"), py::arg("group_id") = 0);
  m.def(
      "unmap_from_kv_tensors",
      [](py::object offs, py::object g) {
        auto o = to_i64_list(offs, "offsets");
        int gid = to_group(g);
        py::gil_scoped_release nogil;
        group_of(gid)->unmap(o);
      },
      py::arg("offsets"), py::arg("group_id") = 0);
  m.def(
      "prepare_unmap_from_kv_tensors",
      [](py::object tx, py::object offs, py::object g) {
        int64_t t = to_i64(tx, "tx_id");
        auto o = to_i64_list(offs, "offsets");
        int gid = to_group(g);
        py::gil_scoped_release nogil;
        group_of(gid)->prepare_unmap(t, o);
      },
      py::arg("tx_id"), py::arg("offsets"), py::arg("group_id") = 0);
  m.def(
      "commit_unmap_from_kv_tensors",
      [](py::object tx, py::object g) {
        int64_t t = to_i64(tx, "tx_id");
        int gid = to_group(g);
        py::gil_scoped_release nogil;
        group_of(gid)->commit_unmap(t);
      },
      py::arg("tx_id"), py::arg("group_id") = 0);
  m.def(
      "abort_unmap_from_kv_tensors",
      [](py::object tx, py::object g) {
        int64_t t = to_i64(tx, "tx_id");
        int gid = to_group(g);
        py::gil_scoped_release nogil;
        group_of(gid)->abort_unmap(t);
      },
      py::arg("tx_id"), py::arg("group_id") = 0);
  m.def(
      "unmap_transaction_outcome",
      [](int64_t tx, int g) {
        switch (group_of(g)->tx_outcome(tx)) {
          case TxOutcome::Prepared: return "prepared";
          case TxOutcome::Committed: return "committed";
          case TxOutcome::Aborted: return "aborted";
          default: return "unknown";
        }
      },
      py::arg("tx_id"), py::arg("group_id") = 0);
  m.def("mapped_offsets", [](int g) { return group_of(g)->mapped_offsets(); }, py::arg("group_id") = 0);
  m.def(
      "group_info",
      [](int g) {
        auto a = group_of(g);
        auto s = a->stats();
        return py::dict(py::arg("group_id") = g, py::arg("page_size") = a->page_size(),
                        py::arg("contiguous_layout") = a->contiguous(), py::arg("buffer_size") = a->buffer_size(),
                        py::arg("num_layers") = a->num_layers(), py::arg("num_kv_buffers") = a->num_kv_buffers(),
                        py::arg("num_pages") = a->num_pages(), py::arg("bytes_per_page") = a->bytes_per_page(),
                        py::arg("mapped_pages") = s.mapped_pages, py::arg("prepared_pages") = s.prepared_pages,
                        py::arg("physical_bytes") = s.physical_bytes, py::arg("quarantined") = s.quarantined,
                        py::arg("quarantined_bytes") = s.quarantined_bytes,
                        py::arg("pending_transactions") = s.pending_transactions,
                        py::arg("failed") = a->failed(), py::arg("failure") = a->failure());
      },
      py::arg("group_id") = 0);

  // ---- backend ---------------------------------------------------------------
  m.def(
      "backend_info",
      [](const std::string& dev) {
        auto b = get_backend(dev);
        size_t free_b = 0, total_b = 0;
        {
          py::gil_scoped_release nogil;
          b->mem_info(&free_b, &total_b);
        }
        return py::dict(py::arg("name") = b->name(), py::arg("device") = b->device().str(),
                        py::arg("granularity") = b->granularity(), py::arg("live_handles") = b->live_handles(),
                        py::arg("live_bytes") = b->live_bytes(), py::arg("free_bytes") = free_b,
                        py::arg("total_bytes") = total_b);
      },
      py::arg("device"));

  // Raw backend calls, for benchmarks against the same driver path.
  py::class_<Backend, std::shared_ptr<Backend>>(m, "RawBackend")
      .def(py::init([](const std::string& dev) { return get_backend(dev); }), py::arg("device"))
      .def_property_readonly("name", &Backend::name)
      .def_property_readonly("granularity", &Backend::granularity)
      .def("reserve", &Backend::reserve, py::arg("size"), py::arg("alignment"), release_gil())
      .def("free_reservation", &Backend::free_reservation, release_gil())
      .def("create", &Backend::create, release_gil())
      .def("map", &Backend::map, release_gil())
      .def("set_access", &Backend::set_access, release_gil())
      .def("unmap", &Backend::unmap, release_gil())
      .def("release", &Backend::release, release_gil())
      .def(
          "map_pages",
          [](Backend& b, uintptr_t va, size_t page, size_t n, PhysHandle zero) {
            // The raw driver loop: create+map+set_access of n pages at va,
            // va+page, ...; with a zero handle, each unit first gives up the
            // zero page mapped there (the sequence kvcached itself runs).
            std::vector<PhysHandle> hs;
            hs.reserve(n);
            for (size_t i = 0; i < n; ++i) {
              PhysHandle h = b.create(page);
              if (zero) b.unmap(va + i * page, page);
              b.map(va + i * page, page, h);
              b.set_access(va + i * page, page);
              hs.push_back(h);
            }
            return hs;
          },
          py::arg("va"), py::arg("page"), py::arg("n"), py::arg("zero") = 0, release_gil())
      .def(
          "unmap_pages",
          [](Backend& b, uintptr_t va, size_t page, const std::vector<PhysHandle>& hs, PhysHandle zero) {
            for (size_t i = 0; i < hs.size(); ++i) {
              b.unmap(va + i * page, page);
              if (zero) {
                b.map(va + i * page, page, zero);
                b.set_access(va + i * page, page);
              }
              b.release(hs[i], page);
            }
          },
          py::arg("va"), py::arg("page"), py::arg("handles"), py::arg("zero") = 0, release_gil())
      .def(
          "fill",
          [](Backend& b, uintptr_t va, size_t page, size_t n, PhysHandle h) {
            for (size_t i = 0; i < n; ++i) b.map(va + i * page, page, h);
            b.set_access(va, page * n);
          },
          release_gil())
      .def(
          "clear",
          [](Backend& b, uintptr_t va, size_t page, size_t n) {
            for (size_t i = 0; i < n; ++i) b.unmap(va + i * page, page);
          },
          release_gil());

  // ---- fault injection ------------------------------------------------------
  m.def(
      "inject_fault", [](const std::string& op, int64_t nth, int64_t count) { faults::arm(parse_op(op), nth, count); },
      py::arg("op"), py::arg("nth") = 1, py::arg("count") = 1,
      "Make the nth call of op (create/map/set_access/unmap/release) from now fail, count times (<0: always).");
  m.def("clear_faults", &faults::clear);
  m.def("fault_calls", [](const std::string& op) { return faults::calls(parse_op(op)); });
  m.def("faults_injected", [](const std::string& op) { return faults::injected(parse_op(op)); });

  // ---- PageAllocator --------------------------------------------------------
  py::class_<PageAllocator, std::shared_ptr<PageAllocator>>(m, "PageAllocator")
      .def(py::init([](size_t num_layers, size_t mem_size_per_layer, size_t page_size, size_t num_kv_buffers,
                       int group_id, size_t min_reserved, size_t max_reserved, bool enable_prealloc,
                       py::object map_fn, py::object unmap_fn) {
             PageAllocatorOptions o;
             o.num_layers = num_layers;
             o.mem_size_per_layer = mem_size_per_layer;
             o.page_size = page_size;
             o.num_kv_buffers = num_kv_buffers;
             o.min_reserved = min_reserved;
             o.max_reserved = max_reserved;
             o.enable_prealloc = enable_prealloc;
             std::shared_ptr<Mapper> mapper;
             if (map_fn.is_none() != unmap_fn.is_none()) invalid("PageAllocator: give both map_fn and unmap_fn, or neither");
             if (map_fn.is_none()) {
               mapper = make_local_mapper(group_id);
             } else {
               mapper = std::make_shared<PyMapper>(map_fn.cast<py::function>(), unmap_fn.cast<py::function>());
               o.allow_prealloc = false;
             }
             py::gil_scoped_release nogil;
             return std::make_shared<PageAllocator>(o, mapper);
           }),
           py::arg("num_layers"), py::arg("mem_size_per_layer"), py::arg("page_size"), py::arg("num_kv_buffers") = 2,
           py::arg("group_id") = 0, py::arg("min_reserved") = 0, py::arg("max_reserved") = 0,
           py::arg("enable_prealloc") = true, py::arg("map_fn") = py::none(), py::arg("unmap_fn") = py::none())
      .def("alloc_page", &PageAllocator::alloc_page, release_gil())
      .def(
          "alloc_pages",
          [](PageAllocator& pa, py::object n) {
            size_t k = to_size(n, "n");
            py::gil_scoped_release nogil;
            return pa.alloc_pages(k);
          },
          py::arg("n"))
      .def(
          "free_page",
          [](PageAllocator& pa, py::object id) {
            int64_t i = to_i64(id, "page id");
            py::gil_scoped_release nogil;
            pa.free_page(i);
          },
          py::arg("id"))
      .def(
          "free_pages",
          [](PageAllocator& pa, py::object ids) {
            auto v = to_i64_list(ids, "page ids");
            py::gil_scoped_release nogil;
            pa.free_pages(v);
          },
          py::arg("ids"))
      .def("trim", &PageAllocator::trim, release_gil())
      .def(
          "resize",
          [](PageAllocator& pa, py::object bytes) {
            size_t b = to_size(bytes, "mem_size_per_layer");
            py::gil_scoped_release nogil;
            return pa.resize(b);
          },
          py::arg("mem_size_per_layer"))
      .def(
          "set_mem_limit",
          [](PageAllocator& pa, py::object bytes) {
            pa.set_mem_limit(to_i64_in(bytes, "memory limit (bytes, -1: none)", -1, INT64_MAX));
          },
          py::arg("bytes"))
      .def("mem_limit", &PageAllocator::mem_limit)
      .def(
          "set_reserve_bounds",
          [](PageAllocator& pa, py::object lo, py::object hi) {
            pa.set_reserve_bounds(to_size(lo, "min_reserved"), to_size(hi, "max_reserved"));
          },
          py::arg("min_reserved"), py::arg("max_reserved"))
      .def("attach_tracker", &PageAllocator::attach_tracker, py::arg("tracker"))
      .def("start_prealloc_thread", &PageAllocator::start_prealloc_thread)
      .def("stop_prealloc_thread", &PageAllocator::stop_prealloc_thread, release_gil())
      .def("get_num_free_pages", &PageAllocator::num_free_pages)
      .def("get_num_inuse_pages", &PageAllocator::num_inuse_pages)
      .def("get_num_reserved_pages", &PageAllocator::num_reserved_pages)
      .def("is_page_reserved", &PageAllocator::is_reserved, py::arg("page_id"))
      .def("get_num_total_pages", &PageAllocator::num_total_pages)
      .def("get_num_virtual_pages", &PageAllocator::num_virtual_pages)
      .def("get_num_mapped_pages", &PageAllocator::num_mapped_pages)
      .def("get_num_quarantined_pages", &PageAllocator::num_quarantined_pages)
      .def(
          "get_page_id",
          [](PageAllocator& pa, py::object b, py::object sz) {
            return pa.get_page_id(to_i64(b, "block_id"), to_i64(sz, "block_mem_size"));
          },
          py::arg("block_id"), py::arg("block_mem_size"))
      .def("last_error", &PageAllocator::last_error)
      .def_property_readonly("page_size", &PageAllocator::page_size)
      .def_property_readonly("bytes_per_page", &PageAllocator::bytes_per_page);

  // ---- shared-memory records ------------------------------------------------
  py::class_<MemInfoSnapshot>(m, "MemInfoSnapshot")
      .def_readonly("name", &MemInfoSnapshot::name)
      .def_readonly("engine", &MemInfoSnapshot::engine)
      .def_readonly("device_type", &MemInfoSnapshot::device_type)
      .def_readonly("device_index", &MemInfoSnapshot::device_index)
      .def_readonly("owner_pid", &MemInfoSnapshot::owner_pid)
      .def_readonly("owner_alive", &MemInfoSnapshot::owner_alive)
      .def_readonly("owner_locked", &MemInfoSnapshot::owner_locked)
      .def_readonly("revision", &MemInfoSnapshot::revision)
      .def_readonly("limit", &MemInfoSnapshot::limit)
      .def_readonly("used", &MemInfoSnapshot::used)
      .def_readonly("prealloc", &MemInfoSnapshot::prealloc)
      .def_readonly("total", &MemInfoSnapshot::total)
      .def_readonly("updated_ns", &MemInfoSnapshot::updated_ns)
      .def_readonly("owner_start_time", &MemInfoSnapshot::owner_start_time)
      .def_readonly("granted", &MemInfoSnapshot::granted)
      .def_readonly("device_bytes", &MemInfoSnapshot::device_bytes)
      .def_readonly("applied_revision", &MemInfoSnapshot::applied_revision)
      .def_readonly("wanted", &MemInfoSnapshot::wanted)
      .def_readonly("wanted_ns", &MemInfoSnapshot::wanted_ns)
      .def_readonly("quarantined", &MemInfoSnapshot::quarantined)
      .def_readonly("owner_uid", &MemInfoSnapshot::owner_uid)
      .def_readonly("problem", &MemInfoSnapshot::problem)
      .def_readonly("busy", &MemInfoSnapshot::busy)
      .def_readonly("record_version", &MemInfoSnapshot::record_version)
      .def_readonly("has_stats", &MemInfoSnapshot::has_stats)
      .def_readonly("stats_problem", &MemInfoSnapshot::stats_problem)
      .def_readonly("want_since_ns", &MemInfoSnapshot::want_since_ns)
      .def_readonly("counters", &MemInfoSnapshot::counters)
      .def_readonly("hist_buckets", &MemInfoSnapshot::hist_buckets)
      .def_readonly("hist_sum_ns", &MemInfoSnapshot::hist_sum_ns);
  // The statistics' names and bucket bounds: the order of the snapshot's lists.
  m.def("record_stats_layout", [] {
    py::list counters, hists;
    for (int i = 0; i < static_cast<int>(StatCounter::Count); ++i) {
      counters.append(stat_counter_name(static_cast<StatCounter>(i)));
    }
    for (int h = 0; h < static_cast<int>(StatHist::Count); ++h) {
      const int64_t* b = stat_hist_bounds_ns(static_cast<StatHist>(h));
      hists.append(py::make_tuple(stat_hist_name(static_cast<StatHist>(h)), std::vector<int64_t>(b, b + kStatBuckets)));
    }
    py::dict d;
    d["counters"] = counters;
    d["histograms"] = hists;
    d["record_version"] = kMemInfoVersion;
    return d;
  });
  constexpr int64_t kMaxBytes = kMaxRecordBytes;
  py::class_<MemInfoTracker, std::shared_ptr<MemInfoTracker>>(m, "MemInfoTracker")
      .def_static(
          "create",
          [](const std::string& n, const std::string& e, py::object dt, py::object di, py::object total,
             py::object limit) {
            int t = static_cast<int>(to_i64_in(dt, "device_type", 0, 2));
            int i = static_cast<int>(to_i64_in(di, "device_index", 0, 0xffff));
            int64_t tot = to_i64_in(total, "total", 0, kMaxBytes), lim = to_i64_in(limit, "limit", 0, kMaxBytes);
            py::gil_scoped_release nogil;
            return std::make_shared<MemInfoTracker>(MemInfoTracker::create(n, e, t, i, tot, lim));
          },
          py::arg("name"), py::arg("engine"), py::arg("device_type"), py::arg("device_index"), py::arg("total"),
          py::arg("limit"))
      .def_static(
          "open", [](const std::string& n) { return std::make_shared<MemInfoTracker>(MemInfoTracker::open(n)); },
          py::arg("name"), release_gil())
      .def_property_readonly("name", &MemInfoTracker::name)
      // Bounded, but may wait (a write in progress): without the GIL.
      .def("snapshot", &MemInfoTracker::snapshot, release_gil())
      .def(
          "publish_usage",
          [](MemInfoTracker& t, py::object used, py::object prealloc) {
            t.publish_usage(to_i64_in(used, "used", 0, kMaxBytes), to_i64_in(prealloc, "prealloc", 0, kMaxBytes));
          },
          py::arg("used"), py::arg("prealloc"))
      .def(
          "set_total", [](MemInfoTracker& t, py::object b) { t.set_total(to_i64_in(b, "total", 0, kMaxBytes)); },
          py::arg("total"))
      .def(
          "set_limit",
          [](MemInfoTracker& t, py::object limit, py::object expected) {
            int64_t l = to_i64_in(limit, "limit", 0, kMaxBytes);
            int64_t r = to_i64_in(expected, "expected_revision", -1, UINT32_MAX);
            py::gil_scoped_release nogil;
            return t.set_limit(l, r);
          },
          py::arg("limit"), py::arg("expected_revision") = -1)
      .def(
          "wait_for_change",
          [](MemInfoTracker& t, py::object seen, py::object timeout_ms) {
            uint32_t s = static_cast<uint32_t>(to_i64_in(seen, "seen", 0, UINT32_MAX));
            int ms = static_cast<int>(to_i64_in(timeout_ms, "timeout_ms", 0, INT32_MAX));
            py::gil_scoped_release nogil;
            return t.wait_for_change(s, ms);
          },
          py::arg("seen"), py::arg("timeout_ms"))
      .def("wake", &MemInfoTracker::wake)
      .def("wake_count", &MemInfoTracker::wake_count)
      .def(
          "set_granted", [](MemInfoTracker& t, py::object b) { t.set_granted(to_i64(b, "granted bytes")); },
          py::arg("bytes"))
      .def(
          "set_device_bytes", [](MemInfoTracker& t, py::object b) { t.set_device_bytes(to_i64(b, "device bytes")); },
          py::arg("bytes"))
      .def(
          "ack_revision",
          [](MemInfoTracker& t, py::object r) {
            t.ack_revision(static_cast<uint32_t>(to_i64_in(r, "revision", 0, UINT32_MAX)));
          },
          py::arg("revision"))
      .def(
          "set_wanted", [](MemInfoTracker& t, py::object b) { t.set_wanted(to_i64(b, "wanted bytes")); },
          py::arg("bytes"))
      .def(
          "set_quarantined",
          [](MemInfoTracker& t, py::object b) { t.set_quarantined(to_i64(b, "quarantined bytes")); },
          py::arg("bytes"))
      .def_property_readonly("has_stats", &MemInfoTracker::has_stats)
      // Python's side of the statistics (refusals, give-backs): by name, from
      // paths that already batch (never per block). No-ops on a version-1 record.
      .def(
          "add_counter",
          [](MemInfoTracker& t, const std::string& name, py::object n) {
            uint64_t v = static_cast<uint64_t>(to_i64_in(n, "count", 0, INT64_MAX));
            for (int i = 0; i < static_cast<int>(StatCounter::Count); ++i) {
              if (name == stat_counter_name(static_cast<StatCounter>(i))) return t.add_counter(static_cast<StatCounter>(i), v);
            }
            invalid("no record counter named '" + name + "'; see kvcached._C.record_stats_layout()");
          },
          py::arg("name"), py::arg("n") = 1)
      .def(
          "observe",
          [](MemInfoTracker& t, const std::string& name, double seconds) {
            if (!(seconds >= 0.0 && seconds < 1e9)) invalid("observe: seconds must be in [0, 1e9), got " + std::to_string(seconds));
            for (int h = 0; h < static_cast<int>(StatHist::Count); ++h) {
              if (name == stat_hist_name(static_cast<StatHist>(h))) {
                return t.observe(static_cast<StatHist>(h), static_cast<int64_t>(seconds * 1e9));
              }
            }
            invalid("no record histogram named '" + name + "'; see kvcached._C.record_stats_layout()");
          },
          py::arg("name"), py::arg("seconds"))
      .def("unlink", &MemInfoTracker::unlink);
  m.def("list_mem_info_records", &list_mem_info_records, release_gil());
  m.def("record_owner_locked", &record_owner_locked, py::arg("name"), release_gil());
  m.def("delete_mem_info_record", &delete_mem_info_record, py::arg("name"), py::arg("force") = false, release_gil());
  m.def("process_alive", &process_alive, py::arg("pid"), py::arg("start_time") = 0);
}
