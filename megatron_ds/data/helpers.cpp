// Index builders for GPT datasets (pybind11 module megatron_ds.data._helpers).
//
// Both functions are sequential scans that are slow in Python at the 10^9-token scale.
// megatron_ds/data/helpers.py holds NumPy versions with identical results; the tests prove it.
// The GIL is released while scanning so other Python threads (the index-cache heartbeat)
// keep running during a long build.

// The blending error w * i - n must be rounded twice (multiply, then subtract) exactly as
// Python/NumPy do, or a fused multiply-add can flip a near-tie and the two backends disagree.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// Walk the token stream formed by the documents of doc_idx, one sample of seq_length + 1 tokens
// at a time; consecutive samples share one token (the last input token is the next label).
// Row k of out holds (index into doc_idx, token offset in that document) where sample k starts.
template <typename DocT, typename OutT>
void fill_sample_idx(const int32_t* sizes, int64_t num_sizes, const DocT* doc_idx, int64_t num_docs,
                     int32_t seq_length, int64_t num_samples, OutT* out) {
    int64_t doc_pos = 0;     // index into doc_idx
    int64_t doc_offset = 0;  // first unused token of the current document
    out[0] = 0;
    out[1] = 0;
    for (int64_t sample = 1; sample <= num_samples; ++sample) {
        int64_t remaining = static_cast<int64_t>(seq_length) + 1;
        while (remaining != 0) {
            if (doc_pos >= num_docs) {
                throw std::invalid_argument(
                    "build_sample_idx: doc_idx holds fewer tokens than num_epochs * tokens_per_epoch");
            }
            const int64_t doc = static_cast<int64_t>(doc_idx[doc_pos]);
            if (doc < 0 || doc >= num_sizes) {
                throw std::out_of_range("build_sample_idx: doc_idx entry " + std::to_string(doc) +
                                        " is outside sizes (" + std::to_string(num_sizes) + " documents)");
            }
            const int64_t available = static_cast<int64_t>(sizes[doc]) - doc_offset;
            remaining -= available;
            if (remaining <= 0) {
                // The sample ends inside this document; its last token starts the next sample.
                doc_offset += remaining + available - 1;
                remaining = 0;
            } else {
                ++doc_pos;
                doc_offset = 0;
            }
        }
        out[2 * sample] = static_cast<OutT>(doc_pos);
        out[2 * sample + 1] = static_cast<OutT>(doc_offset);
    }
}

template <typename DocT>
py::array build_sample_idx_typed(const py::array_t<int32_t, py::array::c_style>& sizes,
                                 const py::array_t<DocT, py::array::c_style>& doc_idx, int32_t seq_length,
                                 int64_t num_epochs, int64_t tokens_per_epoch) {
    if (sizes.ndim() != 1 || doc_idx.ndim() != 1) {
        throw std::invalid_argument("build_sample_idx: sizes and doc_idx must be 1-D arrays");
    }
    if (seq_length < 1 || num_epochs < 1 || tokens_per_epoch < 1) {
        throw std::invalid_argument("build_sample_idx: seq_length, num_epochs and tokens_per_epoch must be >= 1");
    }
    const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;
    const int64_t num_docs = doc_idx.shape(0);
    const bool narrow = num_samples + 1 <= kInt32Max && num_docs <= kInt32Max;
    const int32_t* sizes_ptr = sizes.data();
    const DocT* doc_ptr = doc_idx.data();
    const int64_t num_sizes = sizes.shape(0);
    if (narrow) {
        py::array_t<int32_t> out({num_samples + 1, int64_t{2}});
        int32_t* out_ptr = out.mutable_data();
        {
            py::gil_scoped_release release;
            fill_sample_idx(sizes_ptr, num_sizes, doc_ptr, num_docs, seq_length, num_samples, out_ptr);
        }
        return std::move(out);
    }
    py::array_t<int64_t> out({num_samples + 1, int64_t{2}});
    int64_t* out_ptr = out.mutable_data();
    {
        py::gil_scoped_release release;
        fill_sample_idx(sizes_ptr, num_sizes, doc_ptr, num_docs, seq_length, num_samples, out_ptr);
    }
    return std::move(out);
}

// Dispatch on doc_idx's dtype so neither int32 nor int64 inputs are copied.
py::array build_sample_idx(const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& sizes,
                           const py::array& doc_idx, int32_t seq_length, int64_t num_epochs,
                           int64_t tokens_per_epoch) {
    if (py::isinstance<py::array_t<int32_t>>(doc_idx)) {
        return build_sample_idx_typed<int32_t>(sizes, py::array_t<int32_t, py::array::c_style>::ensure(doc_idx),
                                               seq_length, num_epochs, tokens_per_epoch);
    }
    auto as64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(doc_idx);
    if (!as64) {
        throw std::invalid_argument("build_sample_idx: doc_idx must be an integer array");
    }
    return build_sample_idx_typed<int64_t>(sizes, as64, seq_length, num_epochs, tokens_per_epoch);
}

// Greedy interleaving: sample i goes to the dataset furthest behind its target share
// weights[d] * i (the first one on ties), so every prefix of the blend tracks the weights.
template <typename IndexT>
void fill_blending(const double* weights, int64_t num_datasets, int64_t size, IndexT* dataset_index,
                   int64_t* dataset_sample_index) {
    std::vector<int64_t> taken(static_cast<size_t>(num_datasets), 0);
    for (int64_t i = 0; i < size; ++i) {
        const double position = i > 1 ? static_cast<double>(i) : 1.0;
        int64_t best = 0;
        double best_error = weights[0] * position - static_cast<double>(taken[0]);
        for (int64_t d = 1; d < num_datasets; ++d) {
            const double error = weights[d] * position - static_cast<double>(taken[d]);
            if (error > best_error) {
                best_error = error;
                best = d;
            }
        }
        dataset_index[i] = static_cast<IndexT>(best);
        dataset_sample_index[i] = taken[best];
        ++taken[best];
    }
}

py::tuple build_blending_indices(const py::array_t<double, py::array::c_style | py::array::forcecast>& weights,
                                 int64_t size) {
    if (weights.ndim() != 1 || weights.shape(0) < 1) {
        throw std::invalid_argument("build_blending_indices: weights must be a non-empty 1-D array");
    }
    if (size < 0) {
        throw std::invalid_argument("build_blending_indices: size must be >= 0");
    }
    const int64_t num_datasets = weights.shape(0);
    if (num_datasets > std::numeric_limits<int16_t>::max()) {
        throw std::invalid_argument("build_blending_indices: at most 32767 datasets can be blended");
    }
    const double* w = weights.data();
    py::array_t<int64_t> sample_index(size);
    int64_t* sample_ptr = sample_index.mutable_data();
    if (num_datasets <= 256) {
        py::array_t<uint8_t> dataset_index(size);
        uint8_t* index_ptr = dataset_index.mutable_data();
        {
            py::gil_scoped_release release;
            fill_blending(w, num_datasets, size, index_ptr, sample_ptr);
        }
        return py::make_tuple(dataset_index, sample_index);
    }
    py::array_t<int16_t> dataset_index(size);
    int16_t* index_ptr = dataset_index.mutable_data();
    {
        py::gil_scoped_release release;
        fill_blending(w, num_datasets, size, index_ptr, sample_ptr);
    }
    return py::make_tuple(dataset_index, sample_index);
}

}  // namespace

PYBIND11_MODULE(_helpers, m) {
    m.doc() = "megatron_ds data index helpers: GPT sample index and dataset blending";
    m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"), py::arg("seq_length"),
          py::arg("num_epochs"), py::arg("tokens_per_epoch"),
          "[(num_epochs * tokens_per_epoch - 1) // seq_length + 1, 2] array of (doc_idx position, offset) "
          "where each sample of seq_length + 1 tokens starts; int32 when it fits, else int64.");
    m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"),
          "(dataset_index uint8 (int16 above 256 datasets), dataset_sample_index int64) for a greedy blend.");
}
