//! The graph observer of a calibration run: decides which nodes to read and hands their data
//! to the collectors.

use crate::collect::imatrix::{self, ImatrixCollector};
use crate::llama::{sys, GraphObserver, Node};

pub struct CalibrationObserver {
    pub imatrix: ImatrixCollector,
    /// the chunk being computed, for error messages
    pub chunk: i32,
    /// the first failure; the graph is stopped when it is set
    pub failure: Option<String>,
    scratch_src1: Vec<u8>,
    scratch_ids: Vec<u8>,
}

impl CalibrationObserver {
    pub fn new(imatrix: ImatrixCollector) -> Self {
        CalibrationObserver { imatrix, chunk: 0, failure: None, scratch_src1: Vec::new(), scratch_ids: Vec::new() }
    }
}

impl GraphObserver for CalibrationObserver {
    fn wants(&mut self, node: Node<'_>) -> bool {
        let (Some(src0), Some(src1)) = (node.src(0), node.src(1)) else { return false };
        let t = node.info();
        imatrix::wants(t.op, imatrix::filter_tensor_name(src0.name()), &src1.info(), self.imatrix.cfg.process_output)
    }

    fn observe(&mut self, node: Node<'_>) -> bool {
        let (Some(src0), Some(src1)) = (node.src(0), node.src(1)) else { return true };
        let wname = imatrix::filter_tensor_name(src0.name()).to_string();
        let s1 = src1.info();
        if s1.nb[0] != 4 || s1.ty != sys::GGML_TYPE_F32 {
            self.failure = Some(format!("{wname}: input is not contiguous f32 (type {}, nb0 {})", s1.ty, s1.nb[0]));
            return false;
        }
        let data = src1.bytes(&mut self.scratch_src1);
        let result = if node.info().op == sys::GGML_OP_MUL_MAT_ID {
            let Some(ids) = node.src(2) else {
                self.failure = Some(format!("{wname}: MUL_MAT_ID without ids"));
                return false;
            };
            let ids_data = ids.bytes(&mut self.scratch_ids);
            self.imatrix.collect_mul_mat_id(&wname, src0.info().ne[2], &s1, data, &ids.info(), ids_data)
        } else {
            self.imatrix.collect_mul_mat(&wname, src0.info().ne, &s1, data)
        };
        if let Err(e) = result {
            self.failure = Some(e);
            return false;
        }
        if let Some(nf) = &self.imatrix.error {
            self.failure = Some(format!("non-finite values detected in {} (chunk {})", nf.tensor, self.chunk));
            return false;
        }
        true
    }
}
